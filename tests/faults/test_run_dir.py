"""A refused `llmtrain train` leaves the run dir exactly as it was, and a run dir that cannot be
written is refused before any work.

Hydra used to write `.hydra/{config,hydra,overrides}.yaml` and `train.log` before llmtrain's task
ran, so a command refused later (inside train(): a resume that does not fit, malformed data)
rewrote an existing run's description, and a refused command into a new dir left that dir behind.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmtrain.cli import main
from llmtrain.core import rundir

from ..test_cli_run import TINY, llmtrain

EXIT_USER_ERROR = 2
TINY_TEXT = Path(TINY[1].split("=", 1)[1]).read_text()


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by relative path (the set of files included)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def assert_refused(proc, what: str) -> None:
    assert proc.returncode == EXIT_USER_ERROR, f"{what}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "llmtrain: error:" in proc.stderr, what
    assert "Traceback" not in proc.stderr, f"{what}:\n{proc.stderr}"


@pytest.mark.slow
def test_refused_commands_leave_a_finished_run_dir_byte_for_byte(tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = llmtrain("train", *TINY, "max_steps=2", "report=false", f"hydra.run.dir={run}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for name in (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "train.log"):
        assert (run / name).is_file(), f"an accepted run is still described: {name}"
    before = snapshot(run)

    other = tmp_path / "other.txt"
    other.write_text(TINY_TEXT[::-1])
    malformed = tmp_path / "bad.jsonl"
    malformed.write_text('{"text": "a fine document"}\n{"text": "cut off here\n')
    tiny_model = TINY[3:]  # TINY without its data=text, data.path, data.tokenizer
    refused = {
        "a changed model.n_layer": [*TINY, "model.n_layer=2"],
        "another corpus file": ["data=text", f"data.path={other}", "data.tokenizer=char", *tiny_model],
        "resume=never": [*TINY, "resume=never"],
        "optim=sgd": [*TINY, "optim=sgd"],
        "a changed data.tokenizer": ["data=text", f"data.path={TINY[1].split('=', 1)[1]}", "data.tokenizer=byte",
                                     *tiny_model],
        "a malformed data file": ["data=jsonl", f"data.path={malformed}", "data.tokenizer=char", *tiny_model],
    }
    for what, overrides in refused.items():
        proc = llmtrain("train", *overrides, "max_steps=2", "report=false", f"hydra.run.dir={run}", cwd=tmp_path)
        assert_refused(proc, what)
        assert snapshot(run) == before, f"{what} changed the run dir it was refused for"

    # Accepted, the same run dir's description follows the new command.
    more = llmtrain("train", *TINY, "max_steps=3", "report=false", f"hydra.run.dir={run}", cwd=tmp_path)
    assert more.returncode == 0, more.stderr
    assert "max_steps=3" in (run / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.slow
def test_a_refused_command_leaves_no_new_dir_behind(tmp_path: Path) -> None:
    new = tmp_path / "new"
    proc = llmtrain("train", *TINY, "max_steps=2", "resume=/nonexistent/path", f"hydra.run.dir={new}/deeper",
                    cwd=tmp_path)
    assert_refused(proc, "resume=/nonexistent/path into a new dir")
    assert not new.exists(), sorted(str(p) for p in new.rglob("*"))

    # Hydra's own name (outputs/<date>/<time>) and a sweep dir go as well.
    proc = llmtrain("train", *TINY, "max_steps=2", "resume=/nonexistent/path", cwd=tmp_path)
    assert_refused(proc, "resume=/nonexistent/path into outputs/<date>/<time>")
    assert not (tmp_path / "outputs").exists()
    sweep = tmp_path / "sweep"
    proc = llmtrain("train", "-m", *TINY, "max_steps=2", "optim.lr=1e-3,2e-3", "resume=/nonexistent/path",
                    f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert_refused(proc, "a sweep whose first job is refused")
    assert not sweep.exists(), sorted(str(p) for p in sweep.rglob("*"))


@pytest.mark.slow
def test_out_dir_holds_the_whole_run(tmp_path: Path) -> None:
    out = tmp_path / "od"
    proc = llmtrain("train", *TINY, "max_steps=1", "report=false", f"out_dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for name in (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "train.log", "config.yaml"):
        assert (out / name).is_file(), name
    assert not (tmp_path / "outputs").exists(), "Hydra's own run dir stays empty and goes"


# ---- a run dir that cannot be written: refused before any work, in-process ---------------------


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rundir, "_created", {})
    return tmp_path


def refused_in_process(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as stop:
        main(["train", *argv])
    assert stop.value.code == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("llmtrain: error: ") and err.count("\n") == 1, err
    return err


def test_a_regular_file_is_refused_as_run_dir(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cwd / "notes.txt").write_text("mine\n")
    err = refused_in_process(capsys, "max_steps=1", "hydra.run.dir=notes.txt")
    assert "hydra.run.dir is 'notes.txt'" in err and "a file, not a folder" in err
    err = refused_in_process(capsys, "max_steps=1", "hydra.run.dir=notes.txt/run")
    assert f"{cwd / 'notes.txt'} is a file, not a folder" in err
    err = refused_in_process(capsys, "max_steps=1", "out_dir=notes.txt")
    assert "out_dir is 'notes.txt'" in err
    err = refused_in_process(capsys, "-m", "max_steps=1", "optim.lr=1e-3,2e-3", "hydra.sweep.dir=notes.txt")
    assert "hydra.sweep.dir is 'notes.txt'" in err and "sweep dir" in err
    assert (cwd / "notes.txt").read_text() == "mine\n"
    assert sorted(p.name for p in cwd.iterdir()) == ["notes.txt"], "nothing was created"


def test_a_read_only_file_system_is_refused(cwd: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Root writes through chmod, and mounting needs privileges: the file system says read-only here.
    mount = cwd / "ro"
    mount.mkdir()
    real = os.statvfs

    def statvfs(path: os.PathLike[str] | str) -> object:
        return SimpleNamespace(f_flag=os.ST_RDONLY) if Path(path) == mount else real(path)

    monkeypatch.setattr(os, "statvfs", statvfs)
    err = refused_in_process(capsys, "max_steps=1", f"hydra.run.dir={mount}/run")
    assert f"{mount} is on a read-only file system" in err
    assert not (mount / "run").exists()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes through a read-only mode")
def test_a_folder_without_write_permission_is_refused(cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    locked = cwd / "locked"
    locked.mkdir(mode=0o555)
    try:
        err = refused_in_process(capsys, "max_steps=1", f"hydra.run.dir={locked}/run")
    finally:
        locked.chmod(0o755)
    assert f"{locked} is not writable (permission denied)" in err


# ---- rundir's pieces -----------------------------------------------------------------------------


def test_only_what_this_command_created_is_discarded(cwd: Path) -> None:
    existing = cwd / "existing"
    existing.mkdir()
    rundir.check_dir("hydra.run.dir", str(existing))
    rundir.discard_created(existing)
    assert existing.is_dir(), "a dir from before this command is never removed"

    new = cwd / "a" / "b" / "run"
    rundir.check_dir("hydra.run.dir", str(new))
    new.mkdir(parents=True)
    (new / "partial.txt").write_text("x")
    (cwd / "a" / "beside").mkdir()  # another run started beside it: its parent stays
    rundir.discard_created(new)
    assert not (cwd / "a" / "b").exists() and (cwd / "a" / "beside").is_dir()


def test_the_job_log_holds_records_until_the_run_is_accepted(cwd: Path) -> None:
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    try:
        rundir.hold_job_log()
        logging.getLogger("llmtrain.test").warning("before acceptance")
        assert not (cwd / "train.log").exists()
        rundir.describe_run({".hydra/overrides.yaml": "- max_steps=1\n"}, cwd)
        logging.getLogger("llmtrain.test").warning("after acceptance")
    finally:
        for handler in [h for h in root.handlers
                        if isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent == cwd]:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
    log = (cwd / "train.log").read_text()
    assert "[llmtrain.test][WARNING] - before acceptance" in log and "after acceptance" in log
    assert (cwd / ".hydra" / "overrides.yaml").read_text() == "- max_steps=1\n"

