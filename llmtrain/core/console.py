"""The console every command prints through: rich on a terminal, plain unwrapped lines elsewhere,
and a copy of each print in the run's train.log while `llmtrain train` keeps one."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from rich.console import Console, NewLine
from rich.control import Control

from llmtrain.core import rundir


def warn_on_stderr(message: str) -> None:
    print(f"llmtrain: warning: {message}", file=sys.stderr)
    rundir.log_console(f"llmtrain: warning: {message}")


# Piped output (a file, `| tee`, CI) draws tables this wide: five columns of the check table stay
# readable, and it is the width the test helpers set through COLUMNS.
PIPED_TABLE_WIDTH = 160


class _TrimmedLines:
    """A text stream that drops the spaces rich pads lines with before each line break (table cells,
    justified text), so piped output has no trailing whitespace. The target stream is looked up at
    each write: sys.stdout may be replaced after the console is made (pytest's capture)."""

    def __init__(self, stream: Callable[[], TextIO]) -> None:
        self._stream = stream
        self._spaces = ""  # trailing spaces of the last write: dropped if a line break follows

    def write(self, text: str) -> int:
        *lines, last = (self._spaces + text).split("\n")
        kept = last.rstrip(" ")
        self._spaces = last[len(kept):]
        self._stream().write("\n".join([line.rstrip(" ") for line in lines] + [kept]))
        return len(text)

    def flush(self) -> None:
        self._stream().flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._stream().fileno()

    @property
    def encoding(self) -> str:
        return getattr(self._stream(), "encoding", None) or "utf-8"


@dataclass
class ShownAs:
    """A renderable that train.log keeps as `text` (the banner's table: as the lines a pipe shows)."""

    renderable: Any
    text: str

    def __rich__(self) -> Any:
        return self.renderable


def plain_text(*objects: Any, **kwargs: Any) -> str:
    """What `console.print(*objects, **kwargs)` shows piped (COLUMNS unset): no colour or control
    codes, text unwrapped, tables PIPED_TABLE_WIDTH wide, no trailing spaces."""
    out = io.StringIO()
    Console(file=out, width=PIPED_TABLE_WIDTH, soft_wrap=True, color_system=None, force_terminal=False,
            force_jupyter=False, force_interactive=False).print(
        *(o.text if isinstance(o, ShownAs) else o for o in objects), **kwargs)
    return "\n".join(line.rstrip(" ") for line in out.getvalue().splitlines())


class LoggedConsole(Console):
    """A console whose prints are also copied, as plain text, into the run's train.log while
    `llmtrain train` keeps one (rundir.log_console). A live display's redraws (control codes, and
    the line break that ends it) are not copied; the step lines a progress bar stands for are
    (Dashboard.log_train)."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        super().print(*objects, **kwargs)
        if rundir.job_log_kept() and not (objects and all(isinstance(o, Control | NewLine) for o in objects)):
            rundir.log_console(plain_text(*objects, **kwargs))


def default_console(stderr: bool = False) -> Console:
    """A rich console for stdout (or stderr), whose prints a run's train.log keeps too (LoggedConsole).
    On a terminal: rich's own. Elsewhere (a file, a pipe, CI) plain lines: no colour codes, no
    trailing padding, and, unless COLUMNS is set (then it is the width, as on a terminal that wide),
    text that is never hard-wrapped: a message stays one line, whole for grep. Tables are then drawn
    PIPED_TABLE_WIDTH wide, their cells wrapping inside their column (see `is_plain`)."""
    console = LoggedConsole(stderr=stderr)
    if console.is_terminal:
        return console
    explicit_width = "COLUMNS" in os.environ
    return LoggedConsole(
        file=_TrimmedLines((lambda: sys.stderr) if stderr else (lambda: sys.stdout)),
        width=None if explicit_width else PIPED_TABLE_WIDTH,
        soft_wrap=not explicit_width,
    )


def is_plain(console: Console) -> bool:
    """Whether `console` writes unwrapped plain lines (piped, COLUMNS unset): key/value output is then
    printed as lines rather than as a table that would wrap long values."""
    return console.soft_wrap and not console.is_terminal
