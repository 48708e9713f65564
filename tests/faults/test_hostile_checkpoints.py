"""Checkpoints and run dirs from someone else, or damaged on disk: nothing in them runs, a damaged
one is passed over for an older good one (with a warning naming the file), and when every one is
damaged llmtrain refuses, or (resume=never) moves them aside, instead of overwriting them."""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from llmtrain.checkpoint.read import load_checkpoint, read_weights_file
from llmtrain.checkpoint.shards import hash_files, read_full, read_metadata, write_shards
from llmtrain.config.hydra import config_from_dict
from llmtrain.core.errors import CheckpointError
from llmtrain.engine.optim import build_optimizer
from llmtrain.model import GPT
from llmtrain.runs.artifacts import newest_weights
from llmtrain.training.resume import resume_checkpoint, set_damaged_aside

from ..conftest import run_cli
from ..test_cli_run import TINY

STEP_2, STEP_4 = "step_00000002", "step_00000004"


def llmtrain(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`llmtrain ARGS` in this process (conftest.run_cli: the same output, no new interpreter)."""
    return run_cli(*args, cwd=cwd, columns=200)


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def reseal(checkpoint: Path) -> None:
    """Recompute the manifest's sha256 and size of every file, as a forger would."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        data = (checkpoint / name).read_bytes()
        entry.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=2))


def to_sharded(checkpoint: Path) -> None:
    """Rewrite a full checkpoint in the sharded layout (parallel=fsdp's), with llmtrain's own writer
    run in one process: shards/ instead of model.pt, optimizer.pt holding the groups."""
    trainer = json.loads((checkpoint / "trainer_state.json").read_text())
    cfg = config_from_dict(trainer["config"])
    weights = torch.load(checkpoint / "model.pt", weights_only=True)
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    model = GPT(cfg.model, weights["wte.weight"].shape[0])
    model.load_state_dict(weights)
    optimizer = build_optimizer(model, cfg.optim, "cpu", fused_ok=False)
    optimizer.load_state_dict(saved["optimizer"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        non_tensor = write_shards(checkpoint / "shards", model, optimizer)
    torch.save({"shards": non_tensor, "scaler": saved["scaler"]}, checkpoint / "optimizer.pt")
    (checkpoint / "model.pt").unlink()
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["files"]["model.pt"]
    manifest["layout"] = "sharded"
    manifest["files"].update(hash_files(checkpoint / "shards", 0, 1))
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=2))
    reseal(checkpoint)


class _Payload:
    """Unpickling this creates `marker`: proof that a file ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def forge_metadata(checkpoint: Path, marker: Path) -> None:
    (checkpoint / "shards" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    reseal(checkpoint)


def sha256s(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_one_paragraph(proc: subprocess.CompletedProcess[str], *names: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "weights_only=False" not in proc.stdout + proc.stderr
    error = [line for line in proc.stderr.splitlines() if line.startswith("llmtrain: error:")]
    assert len(error) == 1, proc.stderr
    for name in names:
        assert name in error[0], (name, error[0])


# ---- point 1: a forged sharded checkpoint ---------------------------------------------------------


def test_a_sharded_checkpoint_made_in_one_process_reads_back(run: Path) -> None:
    """The forgeries below start from a genuine sharded checkpoint: it must be refused for its
    payload, not for the conversion."""
    checkpoint = run / "checkpoints" / STEP_4
    weights = torch.load(checkpoint / "model.pt", weights_only=True)
    to_sharded(checkpoint)
    loaded = load_checkpoint(checkpoint)
    assert loaded.sharded
    read = read_full(checkpoint / "shards", loaded.shards, model_only=True)[0]
    assert read.keys() == weights.keys() and all(torch.equal(read[k], weights[k]) for k in weights)
    assert loaded.optimizer["state"], "the optimizer's moments come back too"


def test_forged_metadata_is_refused_without_running_it(run: Path, tmp_path: Path) -> None:
    checkpoint = run / "checkpoints" / STEP_4
    to_sharded(checkpoint)
    marker = tmp_path / "PWNED"
    forge_metadata(checkpoint, marker)
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        load_checkpoint(checkpoint)
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        read_metadata(checkpoint / "shards")
    assert not marker.exists()
    warned: list[str] = []
    found = resume_checkpoint("auto", run, warned.append)
    assert found is not None and found.path.name == STEP_2, "the older good checkpoint is used"
    assert any(".metadata" in w for w in warned), warned
    assert not marker.exists()


def test_forged_metadata_entries_are_refused(run: Path) -> None:
    """A metadata of DCP's own classes can still lie: a non-tensor entry (which DCP would unpickle
    without restriction), a size beyond the data on disk, a piece in a file outside the folder."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    checkpoint = run / "checkpoints" / STEP_4
    to_sharded(checkpoint)
    genuine = (checkpoint / "shards" / ".metadata").read_bytes()

    def forged(change: object) -> str:
        metadata = pickle.loads(genuine)  # noqa: S301 - our own file, written just now
        change(metadata)
        (checkpoint / "shards" / ".metadata").write_bytes(pickle.dumps(metadata))
        reseal(checkpoint)
        with pytest.raises(CheckpointError) as refused:
            load_checkpoint(checkpoint)
        return str(refused.value)

    def bytes_entry(metadata: object) -> None:
        metadata.state_dict_metadata["model/wte.weight"] = BytesStorageMetadata()

    def huge(metadata: object) -> None:
        metadata.state_dict_metadata["model/wte.weight"].size = torch.Size([1 << 20, 1 << 20])

    def outside(metadata: object) -> None:
        next(iter(metadata.storage_data.values())).relative_path = "/etc/passwd"

    assert "BytesStorageMetadata" in forged(bytes_entry)
    assert "bytes of data" in forged(huge)
    assert "/etc/passwd" in forged(outside)


@pytest.mark.slow
def test_forged_sharded_checkpoint_runs_nothing_in_sample_export_or_train(run: Path, tmp_path: Path) -> None:
    to_sharded(run / "checkpoints" / STEP_4)
    marker = tmp_path / "PWNED"
    forge_metadata(run / "checkpoints" / STEP_4, marker)
    sample = llmtrain("sample", str(run), "--max-new-tokens", "5", cwd=tmp_path)
    export = llmtrain("export", str(run), cwd=tmp_path)
    train = llmtrain("train", *TINY, "max_steps=4", "checkpoint.every_steps=2", "report=false",
                     f"hydra.run.dir={run}", cwd=tmp_path)
    assert not marker.exists(), "the forged .metadata ran code"
    for proc in (sample, export, train):  # as for any damaged checkpoint: passed over, with a warning
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        assert "Traceback" not in out
        assert f"{STEP_4}" in out and ".metadata" in out, out
    starts = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"start"' in line]
    assert starts[-1]["resumed_from"].endswith(STEP_2), "train resumed from the older good checkpoint"


# ---- point 2: a foreign pickle in a checkpoint file -------------------------------------------------


def foreign_pickle(path: Path) -> None:
    """A file torch.load(weights_only=True) refuses: it names a class that is no tensor or plain data."""
    torch.save({"note": argparse.Namespace(x=1)}, path)


@pytest.mark.parametrize("name", ["model.pt", "optimizer.pt", "rng.pt", "trainer_state.json"])
def test_a_foreign_file_in_the_newest_checkpoint_falls_back(run: Path, name: str) -> None:
    checkpoint = run / "checkpoints" / STEP_4
    if name.endswith(".json"):
        (checkpoint / name).write_text('{"format": 1, "state": ')  # not JSON
    else:
        foreign_pickle(checkpoint / name)
    reseal(checkpoint)
    warned: list[str] = []
    found = resume_checkpoint("auto", run, warned.append)
    assert found is not None and found.path.name == STEP_2
    assert len(warned) == 1 and name in warned[0] and STEP_4 in warned[0], warned
    assert "weights_only" not in warned[0]
    with pytest.raises(CheckpointError, match=name):
        resume_checkpoint(str(checkpoint), run, warned.append)


@pytest.mark.parametrize("content", [b"", b"not a zip", None])
def test_unreadable_model_pt_is_a_checkpoint_error(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "model.pt"
    if content is None:
        torch.save([1, 2, 3], path)  # loads, but is no state_dict
    else:
        path.write_bytes(content)
    with pytest.raises(CheckpointError, match="model.pt"):
        read_weights_file(path)


def test_a_foreign_final_model_pt_falls_back_to_the_newest_checkpoint(run: Path) -> None:
    foreign_pickle(run / "model.pt")
    warned: list[str] = []
    weights = newest_weights(run, warned.append)
    saved = torch.load(run / "checkpoints" / STEP_4 / "model.pt", weights_only=True)
    assert all(torch.equal(weights[k], saved[k]) for k in saved)
    assert len(warned) == 1 and "model.pt" in warned[0] and "weights_only" not in warned[0], warned


@pytest.mark.slow
def test_foreign_files_give_one_paragraph_in_the_cli(run: Path, tmp_path: Path) -> None:
    foreign_pickle(run / "checkpoints" / STEP_4 / "rng.pt")
    reseal(run / "checkpoints" / STEP_4)
    resume = llmtrain("train", *TINY, "max_steps=6", "report=false", f"resume={run / 'checkpoints' / STEP_4}",
                      f"hydra.run.dir={tmp_path / 'other'}", cwd=tmp_path)
    assert_one_paragraph(resume, "rng.pt", STEP_4)
    shutil.rmtree(run / "checkpoints")
    foreign_pickle(run / "model.pt")
    for command in ("sample", "export"):
        proc = llmtrain(command, str(run), cwd=tmp_path)
        assert_one_paragraph(proc, "model.pt")


# ---- point 4: every checkpoint damaged ----------------------------------------------------------------


def truncate_all(run: Path) -> None:
    for checkpoint in (run / "checkpoints").glob("step_*"):
        data = (checkpoint / "model.pt").read_bytes()
        (checkpoint / "model.pt").write_bytes(data[: len(data) // 2])


def test_all_damaged_is_refused_in_process(run: Path) -> None:
    truncate_all(run)
    before = sha256s(run)
    warned: list[str] = []
    with pytest.raises(CheckpointError) as refused:
        resume_checkpoint("auto", run, warned.append)
    message = str(refused.value)
    for text in (STEP_4, STEP_2, "truncated", "resume=never", "hydra.run.dir"):
        assert text in message, (text, message)
    assert warned == [], "the refusal names them all, once"
    assert sha256s(run) == before


def test_resume_never_moves_damaged_checkpoints_only_once_the_run_is_accepted(run: Path) -> None:
    """Choosing resume=never changes nothing: a refusal after it (a bad data setting found later)
    must leave the run dir as it was; the run moves them aside when it is accepted."""
    truncate_all(run)
    before = sha256s(run)
    assert resume_checkpoint("never", run, lambda message: None) is None
    assert sha256s(run) == before
    said: list[str] = []
    set_damaged_aside(run, said.append)
    assert not (run / "checkpoints").exists() and len(list(run.glob("checkpoints.damaged-*"))) == 1
    assert len(said) == 1 and "moved them aside" in said[0]


@pytest.mark.slow
def test_all_damaged_refuses_then_resume_never_moves_them_aside(run: Path, tmp_path: Path) -> None:
    truncate_all(run)
    before = sha256s(run / "checkpoints")
    everything = sha256s(run)
    args = (*TINY, "max_steps=4", "checkpoint.every_steps=2", "report=false", f"hydra.run.dir={run}")
    refused = llmtrain("train", *args, cwd=tmp_path)
    assert_one_paragraph(refused, STEP_4, STEP_2, "resume=never")
    assert sha256s(run / "checkpoints") == before
    for name in ("model.pt", "metrics.jsonl", "config.yaml", "tokenizer.json"):
        assert sha256s(run)[name] == everything[name], name

    fresh = llmtrain("train", *args, "resume=never", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    aside = list(run.glob("checkpoints.damaged-*"))
    assert len(aside) == 1 and "moved them aside" in fresh.stdout
    assert sha256s(aside[0]) == before, "the damaged checkpoints are kept byte for byte"
    assert (run / "checkpoints" / STEP_4 / "manifest.json").is_file(), "the new run saved its own"

    again = llmtrain("train", *args, "resume=never", cwd=tmp_path)  # a good checkpoint now: refused as before
    assert_one_paragraph(again, "resume=never")
    assert len(list(run.glob("checkpoints.damaged-*"))) == 1


@pytest.mark.slow
def test_all_damaged_is_refused_by_every_rank_together(run: Path, tmp_path: Path) -> None:
    truncate_all(run)
    before = sha256s(run / "checkpoints")
    proc = llmtrain("train", *TINY, "parallel=ddp", "parallel.nproc=2", "max_steps=4", "report=false",
                    f"hydra.run.dir={run}", cwd=tmp_path)  # a hang fails the subprocess timeout
    assert_one_paragraph(proc, STEP_4, STEP_2)
    assert sha256s(run / "checkpoints") == before
