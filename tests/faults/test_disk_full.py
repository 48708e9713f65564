"""A full disk never loses a run's files: ENOSPC is named with the sizes, saves that cannot be
written leave the previous checkpoints (and model.pt) as they were, and the end of the run says
which checkpoint to resume from instead of crashing.

The disk "fills" in-process (no mount, no root): `fill_disk` makes every file opened for writing
under a folder fail its writes with ENOSPC once a condition holds, after writing part of the data,
as a real full disk does."""

from __future__ import annotations

import builtins
import errno
import hashlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from llmtrain.checkpoint.disk import describe_write_error
from llmtrain.checkpoint.read import list_checkpoints, verify
from llmtrain.config.schema import SaveErrorPolicy
from llmtrain.core.atomic import write_file
from llmtrain.core.errors import EXIT_SAVE_FAILED, SaveFailed
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.metrics.writer import MetricsWriter
from llmtrain.training.loop import train

from ..conftest import tiny_config
from ..test_cli_run import TINY

REPO = Path(__file__).resolve().parents[2]


class _FillingFile:
    """A file whose writes fail with ENOSPC while `full()` holds; the failing write lands half of
    its bytes first (a real disk fills mid-write), so a partial tail is on disk when it raises."""

    def __init__(self, fh: Any, full: Callable[[], bool], code: int) -> None:
        self._fh, self._full, self._code = fh, full, code

    def write(self, data: Any) -> int:
        if not self._full():
            return self._fh.write(data)
        data = bytes(data)
        self._fh.write(data[: len(data) // 2])
        self._fh.flush()
        raise OSError(self._code, os.strerror(self._code))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)

    def __enter__(self) -> _FillingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._fh.close()


def fill_disk(root: Path, full: Callable[[Path], bool], code: int = errno.ENOSPC) -> Callable[..., Any]:
    """An `open` for builtins: files opened for writing under `root` fail (errno `code`) while `full(path)`."""
    real_open = builtins.open
    root = Path(os.path.abspath(root))

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        fh = real_open(file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and set(mode) & set("wax+"):
            path = Path(os.path.abspath(file))
            if path.is_relative_to(root):
                return _FillingFile(fh, lambda: full(path), code)
        return fh

    return open_


def after_checkpoint(run_dir: Path, step: int) -> Callable[[Path], bool]:
    """Full for every file once the checkpoint of `step` is in place."""
    folder = run_dir / "checkpoints" / f"step_{step:08d}"
    return lambda path: folder.is_dir()


def captured() -> tuple[Dashboard, io.StringIO]:
    output = io.StringIO()
    return Dashboard(0, Console(file=output, width=400)), output


def jsonl(path: Path) -> list[dict]:
    """Every line must be whole JSON: a dropped record may not leave half a line behind."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def no_temporaries(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.rglob("*") if ".tmp" in p.name or p.name.startswith(".old-")]


SIZES = re.compile(r"no space left on /\S* \(ENOSPC\): the checkpoint needs ~[\d,.]+ MB, [\d,.]+ MB free")


def test_a_checkpoint_that_does_not_fit_is_named_with_sizes_and_model_pt_is_still_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = tmp_path / "run"
    # Only checkpoints/ is full; torch's zip writer then fails mid-file and wraps the OSError.
    monkeypatch.setattr(builtins, "open", fill_disk(run, lambda path: "checkpoints" in path.parts))
    sink, output = captured()
    result = train(tiny_config(run, max_steps=4, **{"checkpoint.every_steps": 2}), console=sink)
    monkeypatch.undo()
    text = output.getvalue()
    assert result.steps == 4
    assert SIZES.search(text), text
    assert "inline_container" not in text and "enforce fail" not in text, (
        "torch's wrapper, not the OSError, was reported"
    )
    assert "No space left on device writing " in text and "model.pt" in text  # the errno text and the file
    assert list_checkpoints(run) == [] and not no_temporaries(run)
    errors = [r for r in jsonl(run / "metrics.jsonl") if r["kind"] == "checkpoint_error"]
    assert [r["step"] for r in errors] == [2, 4, 4], "the saves at 2 and 4, and the final retry"
    assert all(SIZES.search(r["error"]) for r in errors)
    weights = torch.load(run / "model.pt", weights_only=True)
    assert weights.keys() and all(torch.isfinite(t).all() for t in weights.values())


def test_disk_full_after_a_checkpoint_keeps_it_and_names_it_and_the_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = tmp_path / "run"
    monkeypatch.setattr(builtins, "open", fill_disk(run, after_checkpoint(run, 4)))
    sink, output = captured()
    with pytest.raises(SaveFailed) as stopped:
        train(tiny_config(run, max_steps=8, **{"checkpoint.every_steps": 2}), console=sink)
    monkeypatch.undo()
    message = str(stopped.value)
    assert stopped.value.exit_code == EXIT_SAVE_FAILED
    assert f"the final weights could not be written to {run / 'model.pt'}" in message
    assert "no space left on" in message and "(ENOSPC): model.pt needs ~" in message
    newest = run / "checkpoints" / "step_00000004"
    assert stopped.value.checkpoint == newest and f"newest good checkpoint is {newest} (step 4), intact" in message
    verify(newest)
    assert (run / "checkpoints" / "latest").read_text() == "step_00000004"
    assert not (run / "model.pt").exists() and not no_temporaries(run)
    # Records up to the full disk are whole and in order; the later ones are dropped (warned once).
    records = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r["kind"] == "checkpoint"] == [2]  # 4's record: after the disk filled
    assert output.getvalue().count("could not append to") == 1
    assert "ENOSPC" in output.getvalue() and "step_00000006" in output.getvalue()


def test_on_save_error_stop_stops_with_the_save_failed_code_and_the_newest_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = tmp_path / "run"
    monkeypatch.setattr(builtins, "open", fill_disk(run, after_checkpoint(run, 2)))
    with pytest.raises(SaveFailed) as stopped:
        train(tiny_config(run, max_steps=6, **{"checkpoint.every_steps": 2,
                                                "checkpoint.on_save_error": SaveErrorPolicy.stop}),
              console=captured()[0])
    monkeypatch.undo()
    message = str(stopped.value)
    assert "on_save_error=stop" in message and "no space left on" in message
    assert stopped.value.checkpoint == run / "checkpoints" / "step_00000002"
    verify(stopped.value.checkpoint)
    assert not no_temporaries(run)


def test_a_failed_final_save_is_retried_after_the_loop_without_a_closed_sink_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The retry after the loop used to run once metrics.jsonl was closed: ValueError: I/O
    operation on closed file."""
    import llmtrain.checkpoint.write as checkpoint_module

    failures = {"left": 1}

    def first_final_save_fails(path: Path, write: Callable) -> dict:
        if ".tmp-step_00000004" in str(path) and failures["left"]:
            failures["left"] -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write_file(path, write)

    monkeypatch.setattr(checkpoint_module, "write_file", first_final_save_fails)
    run = tmp_path / "run"
    result = train(tiny_config(run, max_steps=4, **{"checkpoint.every_steps": 3}), console=captured()[0])
    assert result.steps == 4 and failures["left"] == 0
    records = jsonl(run / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in records if r["kind"].startswith("checkpoint")] == [
        ("checkpoint", 3), ("checkpoint_error", 4), ("checkpoint", 4)]
    assert [r["kind"] for r in records][-2:] == ["end", "end"], "the peaks after the weights, written after close"
    verify(run / "checkpoints" / "step_00000004")
    assert (run / "model.pt").is_file()


def test_metrics_written_after_close_are_appended_not_raised(tmp_path: Path) -> None:
    metrics = MetricsWriter(tmp_path)
    metrics.write({"kind": "start", "step": 0})
    metrics.close()
    metrics.write({"kind": "checkpoint_error", "step": 1, "error": "disk full"})
    metrics.close()
    assert [r["kind"] for r in jsonl(tmp_path / "metrics.jsonl")] == ["start", "checkpoint_error"]


def test_a_model_pt_that_does_not_fit_leaves_the_previous_one_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, max_steps=3), console=captured()[0])
    before = sha256(run / "model.pt")
    monkeypatch.setattr(builtins, "open",
                        fill_disk(run, lambda path: path.parent == run and path.name.startswith("model.pt")))
    with pytest.raises(SaveFailed, match="holds these weights"):
        train(tiny_config(run, max_steps=4), console=captured()[0])
    monkeypatch.undo()
    assert sha256(run / "model.pt") == before and not no_temporaries(run)
    # Space again: the same command finds step 4 saved and only writes model.pt from it.
    assert train(tiny_config(run, max_steps=4), console=captured()[0]).train_losses == {}
    assert sha256(run / "model.pt") != before


def test_a_write_error_other_than_a_full_disk_keeps_its_errno_text_and_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(builtins, "open", fill_disk(tmp_path, lambda path: True, errno.EACCES))
    with pytest.raises(OSError) as raised:  # torch wraps it in "[enforce fail at inline_container.cc]"
        write_file(tmp_path / "x.pt", lambda f: torch.save({"w": torch.zeros(1000)}, f))
    monkeypatch.undo()
    assert raised.value.errno == errno.EACCES and raised.value.filename == str(tmp_path / "x.pt")
    assert describe_write_error(raised.value, tmp_path, 1000) == f"[Errno 13] Permission denied: '{tmp_path / 'x.pt'}'"


# ---------------------------------------------------------------------------------------------
# the CLI: no traceback, the documented exit code, the command that resumes (and it does)
# ---------------------------------------------------------------------------------------------

_CLI_WITH_FULL_DISK = """
import builtins, sys
from pathlib import Path
from tests.faults.test_disk_full import after_checkpoint, fill_disk
run = Path(sys.argv[1])
builtins.open = fill_disk(run, after_checkpoint(run, int(sys.argv[2])))
from llmtrain.cli import main
main(sys.argv[3:])
"""


@pytest.mark.slow
def test_cli_disk_full_exits_with_the_save_failed_code_and_the_printed_command_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["train", *TINY, "max_steps=6", "checkpoint.every_steps=2", "report=false", f"hydra.run.dir={run}"]
    env = {**os.environ, "COLUMNS": "160", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _CLI_WITH_FULL_DISK, str(run), "2", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_SAVE_FAILED, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "llmtrain: stopped: the final weights could not be written" in proc.stderr
    assert f"newest good checkpoint is {run / 'checkpoints' / 'step_00000002'}" in proc.stderr
    command = proc.stderr.split("To resume exactly where it stopped, run:\n", 1)[1].strip()
    assert command.startswith("llmtrain train ") and f"hydra.run.dir={run}" in command
    verify(run / "checkpoints" / "step_00000002")
    # Space again: the printed command (as given) continues from step 2 and writes model.pt.
    rerun = subprocess.run([sys.executable, "-m", "llmtrain", *shlex.split(command)[1:]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed" in rerun.stdout and "step_00000002" in rerun.stdout
    assert (run / "model.pt").is_file() and list_checkpoints(run)[0].name == "step_00000006"
