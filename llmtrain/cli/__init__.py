"""`llmtrain <command>`: the dispatcher, and the entry point (`llmtrain.cli:main`).

Only the standard library at module level, and each command's module is imported when that
command runs: `llmtrain --help`, `--version` and shell completion answer instantly, and no command
pays for another's imports (torch, hydra, rich).

    train                  llmtrain.cli.train (composed and checked by llmtrain.cli.compose)
    configs                llmtrain.cli.configs (the catalogue of llmtrain.config.catalog)
    eval                   llmtrain.cli.evaluate
    prepare, check, plan, ...  llmtrain.cli.commands
    -sc / --shell-completion   llmtrain.cli.completion

Signals: main() catches SIGTERM first thing, so that one at any moment of start-up (torch takes
seconds to import) ends with `llmtrain: stopped: ...` and exit 75, and a Ctrl-C with
`llmtrain: aborted: ...` and exit 130, for every command; for `train`, StopRequest
(llmtrain.training.interrupts) takes over as soon as it is imported, before the command's module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import NoReturn

COMMANDS: dict[str, str] = {
    "train": "Train a model from the composed config groups (Hydra overrides, -m sweeps).",
    "prepare": "Tokenize a corpus (text files, folders, globs, JSONL) into cached memory-mapped token files.",
    "check": "Pre-flight checklist + memory/compute estimate for a config; exit 0 pass, 1 warn, 2 fail.",
    "plan": "Which parallel layout (ddp, zero1, fsdp, tensor/pipeline parallel) a config needs on N devices, and why.",
    "sample": "Generate text from a run directory's trained model (or an export).",
    "export": "Write a run's weights as safetensors + the model config as JSON.",
    "eval": "Evaluate a model: held-out perplexity / bits per byte, multiple choice, lm-evaluation-harness tasks.",
    "compare": "The runs of a sweep side by side: a table sorted by val loss, a CSV and a PNG of the loss curves.",
    "report": "Post-run review of a run dir: report.md + report.html with plots, a verdict per question.",
    "doctor": "Diagnostic experiments that find bugs fast: overfit, lr-range, grad-check, eval-consistency.",
    "configs": "Browse the config groups: options with descriptions, model sizes, presets; "
               "GROUP=OPTION prints its YAML.",
}

USAGE = """usage: llmtrain <command> [args]

Trains GPT-style language models from composable Hydra config groups.

commands:
{commands}

Run `llmtrain <command> --help` for a command's options, e.g. `llmtrain train --help`.
Quick start: `llmtrain train` trains a small model on Python's own stdlib sources (CPU, no download).
"""


class _Terminated(BaseException):
    """A SIGTERM before a command's own handling of it is in place (train's StopRequest), raised in
    the main thread wherever it is: a BaseException, so that no `except Exception` on the way (an
    import, Hydra) swallows it."""


def _on_sigterm(signum: int, frame: FrameType | None) -> NoReturn:
    raise _Terminated


def main(argv: Sequence[str] | None = None) -> None:
    """Run `llmtrain ARGV...` (sys.argv by default); exits with the command's code when it fails."""
    # First of all, before any import that takes time (torch, Hydra): a SIGTERM from here on ends
    # in one line and exit 75, instead of the kill's silent -15. (Ctrl-C is Python's KeyboardInterrupt
    # from the start.) The handlers in place before are back when main() returns, also in-process.
    previous = _catch_sigterm()
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            _dispatch(args)
        except BaseException as err:
            _ending()  # on the way out: a further signal must not cut the last line short
            from llmtrain.cli.common import signal_stop  # llmtrain.core.errors and the standard library only

            stop = signal_stop(err)  # also what a signal became in code it interrupted half-way
            if stop is None:
                raise
            _end_by_signal(stop, args)
    except SystemExit as exited:
        from llmtrain.core.errors import EXIT_INTERRUPTED

        if argv is None and exited.code == EXIT_INTERRUPTED:  # stopped on request, in a process of its own
            from llmtrain.training.interrupts import exit_promptly

            exit_promptly(EXIT_INTERRUPTED)  # without the interpreter's teardown: seconds on a busy machine
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _end_by_signal(stop: BaseException, args: list[str]) -> NoReturn:
    """One line and the signal's exit code: 130 for a Ctrl-C (or a second signal), 75 for a SIGTERM."""
    # a Ctrl-C outside the train loop (from main()'s first line), or a second signal
    if isinstance(stop, KeyboardInterrupt):
        from llmtrain.core.errors import EXIT_ABORTED
        from llmtrain.training.interrupts import AbortRequested, abort_at_once, abort_message, announce_abort

        if isinstance(stop, AbortRequested):  # at once: the interpreter's teardown can take seconds
            abort_at_once(abort_message(stop))
        announce_abort(abort_message(stop))
        sys.exit(EXIT_ABORTED)
    from llmtrain.cli.common import fail
    from llmtrain.core.errors import EXIT_INTERRUPTED

    what = f"`llmtrain {args[0]}`" if args else "llmtrain"
    fail(f"SIGTERM before {what} finished; the same command starts it again", EXIT_INTERRUPTED, label="stopped")


def _catch_sigterm() -> dict[int, Callable | int]:
    """Install the start-up SIGTERM handler where the default (ending the process) is in place, in
    the main thread (the only one signals reach); a SIGTERM the caller ignores or handles is left to
    it. Returns the handlers to restore at the end (SIGINT's too: `_ending` may change it)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    if previous[signal.SIGTERM] == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    return {sig: handler for sig, handler in previous.items() if handler is not None}  # None: not set from Python


def _ending() -> None:
    """The process is on its way out with its one line: further signals are ignored (main thread)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def _dispatch(args: list[str]) -> None:
    """The first word picks the command (or --help, --version, -sc); its module is imported now."""
    if args[:1] in (["-sc"], ["--shell-completion"]):
        from llmtrain.cli.completion import complete

        complete(args, COMMANDS)
        return
    if not args or args[0] in ("-h", "--help", "help"):
        width = max(len(c) for c in COMMANDS)
        try:
            print(USAGE.format(commands="\n".join(f"  {c:<{width}}  {h}" for c, h in COMMANDS.items())), end="")
            sys.stdout.flush()
        except BrokenPipeError:
            _reader_gone()
        return
    if args[0] == "--version" or (args[0] in COMMANDS and "--version" in args[1:]):  # `llmtrain train --version` too
        print(version_line())
        return
    from llmtrain.cli.common import fail, signals_held
    from llmtrain.core.errors import RunStopped

    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        fail(f"unknown command '{command}'; valid commands: {', '.join(COMMANDS)}. See `llmtrain --help`.")
    try:
        if command == "train":  # SIGTERM/Ctrl-C stop cleanly from here on, also while importing and setting up
            from llmtrain.training.interrupts import StopRequest

            with contextlib.ExitStack() as stopping:
                with signals_held():  # a signal landing while StopRequest installs itself waits until it has
                    stopping.enter_context(StopRequest.shared().setting_up())
                _handler(command)(rest)
        else:
            _handler(command)(rest)
    except RunStopped as stopped:  # a SIGTERM while setting up, outside the run itself (composing the config)
        _ending()
        fail(str(stopped), stopped.exit_code, label="stopped")
    except BrokenPipeError:  # `llmtrain configs | head`: the reader has what it wanted
        _reader_gone()


def version_line() -> str:
    """`llmtrain --version`: llmtrain's version, with the torch, Hydra and Python it runs on (read
    from the installed packages' metadata: nothing is imported, so it answers at once)."""
    import platform
    from importlib import metadata

    from llmtrain import __version__

    found = []
    for name, package in (("torch", "torch"), ("Hydra", "hydra-core")):
        try:
            found.append(f"{name} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return f"llmtrain {__version__} ({', '.join(found)}, Python {platform.python_version()})"


def _reader_gone() -> NoReturn:
    """Stop quietly when stdout's reader closed the pipe, instead of a traceback: stdout is pointed at
    /dev/null first, since the interpreter's flush at exit would hit the closed pipe again. Exit 1,
    as Python itself does on EPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(1)


def _handler(command: str) -> Callable[[list[str]], None]:
    """The function that runs `command`, its module imported now (looked up at call time, so a
    test's monkeypatch of the module reaches it)."""
    if command == "train":
        from llmtrain.cli import train

        return train.train_command
    if command == "eval":
        from llmtrain.cli import evaluate

        return evaluate.eval_command
    if command == "configs":
        from llmtrain.cli import configs

        return configs.configs_command
    from llmtrain.cli import commands

    return {
        "prepare": commands.prepare_command, "check": commands.check_command, "plan": commands.plan_command,
        "sample": commands.sample_command,
        "export": commands.export_command, "compare": commands.compare_command, "report": commands.report_command,
        "doctor": commands.doctor_command,
    }[command]
