"""The run dir around Hydra: checked before any work, described only once a run is accepted, and
removed again when the command that created it is refused.

Hydra would write `.hydra/{config,hydra,overrides}.yaml` and its job log `train.log` into the run
dir before llmtrain's task even starts, so a command refused later (a resume that does not fit,
malformed data) would still overwrite an existing run's description. conf/config.yaml therefore
turns both off (`hydra.output_subdir: null`, a job logging without its file handler), and the CLI
writes the same files itself, through `describe_run`, at the moment train() accepts the run.

train.log is what the run showed: every console line as plain text (`log_console`: the banner, step
and eval lines, warnings, alarms, the summary, the review, a stop and its resume command), and
Python logging's records in Hydra's format, in the order they came. Lines from before the run was
accepted (data preparation, a resume) are held until then, and dropped with a refused run.

Nothing here imports torch, Hydra or OmegaConf (they stay in cli/train.py): the CLI checks paths before
the heavy imports.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from llmtrain.core.atomic import write_atomically
from llmtrain.core.errors import ConfigError
from llmtrain.core.files import JOB_LOG, layout_problems

# Hydra's default job-log format for Python logging's records; console lines are written as shown.
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
CONSOLE_LOGGER = "llmtrain.console"  # the name of console lines in the job log
# How long a console line waits for the job log's lock: the abort's line comes from another thread
# while the main thread may be stuck mid-write, and a second Ctrl-C must end the process within a second.
LOG_LOCK_WAIT_S = 0.2

# Absolute run (or sweep) dirs this command will create, each with the topmost folder of its path
# that did not exist yet: only what this command created may be removed on a refusal.
_created: dict[Path, Path] = {}


def absolute(path: str | os.PathLike[str]) -> Path:
    """As Hydra names its output dir (os.path.abspath: no symlink resolution)."""
    return Path(os.path.abspath(os.fspath(path)))


def dir_problem(path: Path) -> str | None:
    """Why `path` cannot become a run dir (it or a parent is a file; the folder it would be made
    in is on a read-only file system or not writable), or None when it can."""
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "it is" if existing == path else f"{existing} is"
        return f"{where} a file, not a folder"
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        return f"{existing} is on a read-only file system"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable (permission denied)"
    return None


def check_dir(key: str, value: str, what: str = "run dir", example: str = "runs/first") -> Path:
    """Refuse (ConfigError) a run dir `key=value` that cannot be written, before any work; note it as
    created by this command when it does not exist yet. Returns its absolute path."""
    path = absolute(value)
    problem = dir_problem(path)
    misplaced = layout_problems(path) if problem is None and what == "run dir" and path.is_dir() else []
    if misplaced:
        raise ConfigError(f"{key} is '{value}', which cannot be the {what}: {'; '.join(misplaced)}. Nothing was "
                          f"changed there; move that away, or give a new {what}, e.g. {key}={example}.")
    if problem is not None:
        raise ConfigError(
            f"{key} is '{value}', which cannot be the {what}: {problem}. Give a folder you can write to "
            f"(an existing {what} or a new path), e.g. {key}={example}."
        )
    if not os.path.lexists(path):
        top = path
        while not os.path.lexists(top.parent):
            top = top.parent
        _created[path] = top
    return path


def _created_top(path: Path) -> Path | None:
    """The topmost folder this command created above (or at) `path`, when it created `path`: a
    noted dir itself, or a job dir inside a noted sweep dir."""
    for noted, top in _created.items():
        if path == noted or noted in path.parents:
            return top
    return None


def discard_created(
    path: str | os.PathLike[str], only_if_empty: bool = False, keep: frozenset[str] = frozenset()
) -> None:
    """Remove `path` if this command created it (a refused run leaves no dir behind), then the
    parents it created as they become empty. `only_if_empty`: remove it only when it holds nothing
    but the names in `keep`. A dir that existed before this command is never touched."""
    path = absolute(path)
    top = _created_top(path)
    if top is None or not path.is_dir():
        return
    if only_if_empty:
        if any(entry.name not in keep for entry in path.iterdir()):
            return
        for name in keep:
            (path / name).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)
    parent = path.parent
    while parent != top.parent and top in (parent, *parent.parents):
        try:
            parent.rmdir()  # only when empty: another run may have started beside this one
        except OSError:
            break
        parent = parent.parent


class _HeldLog(logging.handlers.MemoryHandler):
    """Log records of a job not yet accepted: kept until its train.log is opened, else dropped."""


class _JobLog(logging.FileHandler):
    """An accepted job's train.log. A line it cannot write (a full disk) is left out of it, quietly:
    train.log copies what the console shows, which says what went wrong; logging's own report would
    print a traceback into the run's output."""

    def handleError(self, record: logging.LogRecord) -> None:  # logging's name for it
        pass


class _JobLogFormat(logging.Formatter):
    """Console lines as they were shown; any other record in Hydra's job-log format."""

    def format(self, record: logging.LogRecord) -> str:
        return record.getMessage() if record.name == CONSOLE_LOGGER else super().format(record)


def _job_log_handlers() -> list[logging.Handler]:
    return [h for h in logging.getLogger().handlers if isinstance(h, _HeldLog | _JobLog)]


def hold_job_log() -> None:
    """A job starts: keep its log records in memory, since train.log is opened only once the run is
    accepted. A previous job's train.log (a sweep's jobs run in one process) is closed first."""
    root = logging.getLogger()
    for previous in _job_log_handlers():
        root.removeHandler(previous)
        previous.close()
    root.addHandler(_HeldLog(capacity=1_000_000, flushLevel=logging.CRITICAL + 1))


def job_log_kept() -> bool:
    """Whether this process keeps a job log now (`llmtrain train`, from the start of its job)."""
    return bool(_job_log_handlers())


def log_console(text: str) -> None:
    """Copy `text`, as the console showed it (plain, without control codes), into train.log (held
    until the run is accepted). It is handed to the job log's handler alone: through the logging
    tree, Hydra's console handler would show it a second time. Nothing when no job log is kept (any
    other command, or train() called from Python)."""
    record = logging.makeLogRecord({"name": CONSOLE_LOGGER, "levelno": logging.INFO, "levelname": "INFO", "msg": text})
    for handler in _job_log_handlers():
        if handler.lock is not None and not handler.lock.acquire(timeout=LOG_LOCK_WAIT_S):
            continue  # the line is lost from train.log rather than the process held (see LOG_LOCK_WAIT_S)
        try:
            handler.handle(record)
        finally:
            if handler.lock is not None:
                handler.lock.release()


def _start_job_log(run_dir: Path) -> None:
    handler = _JobLog(run_dir / JOB_LOG, mode="a", encoding="utf-8")  # a resume appends, as Hydra's did
    handler.setFormatter(_JobLogFormat(LOG_FORMAT))
    root = logging.getLogger()
    for held in [h for h in root.handlers if isinstance(h, _HeldLog)]:
        held.setTarget(handler)
        held.flush()
        root.removeHandler(held)
        held.close()
    root.addHandler(handler)


def describe_run(files: Mapping[str, str], run_dir: Path) -> None:
    """The run was accepted: write Hydra's record of it (`files`, relative to the run dir) and start
    its train.log. train() calls this on the writing rank, beside config.yaml."""
    for name, text in files.items():
        target = run_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(target, text)  # a crash mid-write leaves the previous file whole
    _start_job_log(run_dir)
