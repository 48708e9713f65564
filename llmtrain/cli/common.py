"""What every command module shares: the error exit (`fail`), the reading of a command line that
takes config overrides (`parse_command_line`), what a signal's exception became (`signal_stop`) and
the hold on signals for work that must not be cut half-way, the shipped config folder, a value read
off the command line, and the subnormal switch that must come before any compute.

Only the standard library and `llmtrain.core.errors` at module level, like every module of the CLI:
torch is imported inside the one function that needs it.
"""

from __future__ import annotations

import contextlib
import difflib
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from llmtrain.core.errors import EXIT_USER_ERROR

if TYPE_CHECKING:
    import argparse


def fail(message: str, code: int = EXIT_USER_ERROR, label: str = "error") -> NoReturn:
    """Print `llmtrain: <label>: <message>` (one paragraph, no traceback) and exit with `code`; a
    run's train.log keeps it too (a stop's resume command). An error that a signal caused (see
    signal_stop) is not the user's: the signal's stop goes on instead."""
    stop = signal_stop(sys.exc_info()[1]) if label == "error" else None
    if stop is not None:
        raise stop
    from llmtrain.core.rundir import log_console

    sys.stderr.write(f"llmtrain: {label}: {message}\n")
    log_console(f"llmtrain: {label}: {message}")
    sys.exit(code)


def signal_stop(err: BaseException | None) -> BaseException | None:
    """The exception a signal raised (KeyboardInterrupt, or a SIGTERM's stop: a BaseException that is
    no Exception, so that no `except Exception` swallows it) that `err` is, or that `err` was raised
    from or while handling; None if there is none, and for an exit (the command's own end, with its
    code: a stop's 75 among them). Code a signal interrupts half-way (an import, a library's cleanup)
    can turn that exception into another one; the signal still decides how the command ends."""
    seen: set[int] = set()
    while err is not None and not isinstance(err, SystemExit) and id(err) not in seen:
        if not isinstance(err, Exception | GeneratorExit):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


_HELD = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait (blocked by the kernel, not lost) in this block, and come when it ends
    (or at release_signals()): for work that a signal must not cut half-way, as handlers being
    swapped, or Hydra composing a job's config (its own error report would show a traceback)."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal mask
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def release_signals() -> None:
    """End a signals_held() hold early: a signal that waited is handled now."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)


def parse_command_line(
    parser: argparse.ArgumentParser, args: list[str], intermixed: bool = False
) -> argparse.Namespace:
    """`parser`'s reading of `args` (a command's own parser, or Hydra's for train), where a refusal is
    one paragraph instead of argparse's usage block and terse line: a config value typed as an option
    (`--max_steps 30`, `-max_steps=30`, `--lr 1e-3`) gets the override that was meant."""
    def refuse(message: str) -> NoReturn:
        fail(_argument_error(parser, args, message))

    parser.error = refuse  # type: ignore[method-assign]  # argparse reports every refusal through error()
    return parser.parse_intermixed_args(args) if intermixed else parser.parse_args(args)


def _argument_error(parser: argparse.ArgumentParser, args: list[str], message: str) -> str:
    """The paragraph for argparse's refusal `message` of `args`: about the first word that looks like
    an option and is none of `parser`'s, or else argparse's own words."""
    actions = {option: action for action in parser._actions for option in action.option_strings}
    value_next = False
    for at, word in enumerate(args):
        name, equals, _ = word.partition("=")
        if value_next or not word.startswith("-") or word in ("-", "--") or word[1:2].isdigit() or word[1:2] == ".":
            value_next = False  # a value (of the option before, or a negative number), or an override
            continue
        if name in actions:
            value_next = not equals and actions[name].nargs is None  # `-cd DIR`: DIR is the option's
            continue
        if name.startswith("--") and any(option.startswith(name) for option in actions):
            continue  # an abbreviation (argparse's own message says which options it could be)
        return _not_an_option(parser, word, args[at + 1] if at + 1 < len(args) else "")
    return f"{message} (`{parser.prog} --help` shows what it takes)."


def _not_an_option(parser: argparse.ArgumentParser, word: str, following: str) -> str:
    """`word` is none of `parser`'s options: most often a config value typed as one, written the
    override way here (with a close match for a mistyped key), or else a mistyped option."""
    from llmtrain.config.hydra import closest_key

    name, equals, value = word.partition("=")
    key = name.lstrip("-")
    if not equals:  # `--max_steps 30`: the next word is its value, unless it is an option or an override
        value = following if following and not following.startswith("-") and "=" not in following else "<value>"
    meant = closest_key(key)
    options = [option for action in parser._actions for option in action.option_strings]
    close_option = difflib.get_close_matches(name, options, n=1, cutoff=0.8)
    start = f"'{word}' is not an option of `{parser.prog}`"
    overrides = "config values are key=value overrides, without dashes"
    if name in ("-m", "--multirun"):  # `llmtrain check -m a=1,2`: only train runs sweeps
        return (f"{start}: a sweep (-m, one job per value) runs with `llmtrain train -m ...`; "
                "here give one value per key.")
    if meant is not None and (meant == key or not close_option):
        typo = "" if meant == key else f" ('{key}' is no config key; {meant} is the closest)"
        return f"{start}: {overrides}: write {meant}={value}{typo}."
    if close_option:
        return f"{start}. Did you mean {close_option[0]}? ({overrides.capitalize()}, e.g. max_steps=30.)"
    listing = ", ".join("/".join(action.option_strings) for action in parser._actions if action.option_strings)
    return (f"{start}; its options are {listing}, and {overrides}, e.g. max_steps=30 "
            f"(`{parser.prog} --help` lists them).")


def conf_dir() -> Path:
    """The shipped config groups: inside the installed package, or `conf/` of a source checkout."""
    package = Path(__file__).resolve().parents[1]  # llmtrain/
    candidates = (package / "conf", package.parent / "conf")
    for candidate in candidates:
        if (candidate / "config.yaml").is_file():
            return candidate
    raise RuntimeError(f"llmtrain's config folder is missing (looked in {candidates[0]} and {candidates[1]})")


def check_config_dir(config_dir: str | None) -> None:
    """`--config-dir`/`-cd`, when given, must be a folder: refused in one line before any work."""
    if config_dir and not Path(config_dir).expanduser().is_dir():
        fail(f"--config-dir is '{config_dir}', which is not a folder; give a folder of group options like conf/.")


def given(overrides: list[str], key: str) -> str | None:
    """The value the command line gives `key` (as key=, +key= or ++key=; the last one wins), or None."""
    values = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith(f"{key}=")]
    return values[-1] if values else None


def flush_denormals_first(overrides: list[str]) -> None:
    """Flush subnormal floats to zero before this process computes anything (flush_denormal=false on
    the command line keeps them). Subnormals make CPU kernels many times slower (a 1024^2 matmul 60x,
    fused AdamW 20x here), and the switch is per thread: torch's thread pools take it from the thread
    that starts them, so setting it later, in train(), reaches the main thread only. For train, doctor
    and eval this is torch's first import: it loads whole, with signals held (a SIGTERM or Ctrl-C that
    cuts it half-way can abort the process in torch's C++ registrations); one that comes meanwhile is
    taken right after."""
    with signals_held():
        import torch

    value = given(overrides, "flush_denormal")
    torch.set_flush_denormal(value is None or value.strip().lower() not in ("false", "0", "no", "off"))
