"""Writing full-state checkpoints: atomic, verified, and exact enough to resume bit for bit
(checkpoint/layout.py says what one holds; read.py reads it back).

`save_checkpoint(run_dir, contents)` writes one `CheckpointContents` into a hidden temporary
folder, every file fsync'ed (core/atomic.py), then renames it into place, so a crash mid-save
leaves the previous checkpoints untouched; the manifest (sha256 and size of every file) is written
last. A save that fails names the cause (disk.py: a full disk, how much was free and how much was
needed) and leaves the previous checkpoints as they were. The run's final weights (model.pt) are
written here too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from llmtrain.checkpoint.disk import describe_write_error, needed_bytes, tensor_bytes
from llmtrain.checkpoint.layout import FORMAT_VERSION, LATEST, MANIFEST, checkpoint_root, step_dir_name
from llmtrain.checkpoint.read import find_good_checkpoint
from llmtrain.checkpoint.rng import rng_snapshot
from llmtrain.core.atomic import fsync_dir, swap_folder, write_atomically, write_file
from llmtrain.core.errors import CheckpointSaveError, SaveFailed
from llmtrain.core.files import FINAL_WEIGHTS, TRAINER_STATE
from llmtrain.engine.state import TrainState


@dataclass(frozen=True)
class ShardedFiles:
    """A sharded save's part already on disk: the ranks wrote `shards/` into `folder` (from
    `staging_dir`); `files` are those files' manifest entries and `non_tensor` the optimizer's
    groups and plain state (checkpoint/shards.py), which optimizer.pt keeps."""

    folder: Path
    files: dict[str, dict]
    non_tensor: dict


@dataclass(frozen=True)
class CheckpointContents:
    """Everything one checkpoint holds, as read from the run's objects at a save: the model's and
    the optimizer's state dicts (a full checkpoint; a sharded one has `shards` instead), the
    precision's state (fp16's loss scaler; None without one), the data sampler's position, the
    TrainState, the resolved config, and `extras`: more trainer-state entries (the run's seed, the
    monitor's state)."""

    state: TrainState
    config: dict
    sampler: dict
    precision: dict | None = None
    model: dict | None = None
    optimizer: dict | None = None
    extras: dict = field(default_factory=dict)
    shards: ShardedFiles | None = None


def staging_dir(run_dir: Path, step: int) -> Path:
    """A fresh hidden folder to write a checkpoint of `step` into (renamed into place when whole)."""
    root = checkpoint_root(run_dir)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def save_checkpoint(run_dir: Path, contents: CheckpointContents) -> Path:
    """Write a checkpoint of `contents.state.step` atomically; raises CheckpointSaveError on failure.
    A sharded one (`contents.shards`) completes the folder the ranks staged their shards in."""
    root = checkpoint_root(run_dir)
    name = step_dir_name(contents.state.step)
    final = root / name
    shards = contents.shards
    tmp = shards.folder if shards is not None else root / f".tmp-{name}-{os.getpid()}"
    latest_tmp = root / f".{LATEST}.tmp"
    try:
        if shards is None:
            tmp = staging_dir(run_dir, contents.state.step)
        files = _write_files(tmp, contents)
        manifest = {"format": FORMAT_VERSION, "step": contents.state.step,
                    "layout": "full" if shards is None else "sharded", "files": files}
        write_file(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=2).encode()))
        fsync_dir(tmp)
        # The new `latest` is written before the rename: every byte of the save lands before the
        # checkpoint is in place, so a full disk fails the save with nothing half-done (renames
        # need no space).
        write_file(latest_tmp, lambda f: f.write(name.encode()))
        swap_folder(tmp, final)  # the same step again (after a rollback or a re-run) is replaced whole
        os.replace(latest_tmp, root / LATEST)
        fsync_dir(root)
    except (OSError, RuntimeError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        latest_tmp.unlink(missing_ok=True)
        why = describe_write_error(err, root, _needed_bytes(run_dir, contents))
        raise CheckpointSaveError(f"could not save checkpoint {final}: {why}") from err
    return final


def _write_files(folder: Path, contents: CheckpointContents) -> dict[str, dict]:
    """Every file but the manifest, into `folder`: their manifest entries (a sharded checkpoint's
    shards, written by the ranks, first)."""
    rng_tensors, rng_plain = rng_snapshot()
    trainer = {
        "format": FORMAT_VERSION,
        "state": dataclasses.asdict(contents.state),
        "sampler": contents.sampler,
        "rng": rng_plain,
        "config": contents.config,
        "versions": {"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version()},
        "saved_at": time.time(),
        **contents.extras,
    }
    if contents.shards is None:
        optimizer = {"optimizer": contents.optimizer, "scaler": contents.precision}
        files = {"model.pt": write_file(folder / "model.pt", lambda f: torch.save(contents.model, f)),
                 "optimizer.pt": write_file(folder / "optimizer.pt", lambda f: torch.save(optimizer, f))}
    else:
        optimizer = {"shards": contents.shards.non_tensor, "scaler": contents.precision}
        files = {**contents.shards.files,
                 "optimizer.pt": write_file(folder / "optimizer.pt", lambda f: torch.save(optimizer, f))}
    files["rng.pt"] = write_file(folder / "rng.pt", lambda f: torch.save(rng_tensors, f))
    files[TRAINER_STATE] = write_file(folder / TRAINER_STATE, lambda f: f.write(json.dumps(trainer).encode()))
    return files


def _needed_bytes(run_dir: Path, contents: CheckpointContents) -> int | None:
    """About what the checkpoint takes: its shards and optimizer groups, or its state dicts' tensors;
    else the newest checkpoint's size."""
    shards = contents.shards
    if shards is not None:
        try:
            written = sum(entry["bytes"] for entry in shards.files.values())
        except (KeyError, TypeError):
            return needed_bytes(run_dir)
        return needed_bytes(run_dir, shards.non_tensor, written=written)
    if contents.model is not None and contents.optimizer is not None:
        return needed_bytes(run_dir, contents.model, contents.optimizer)
    return needed_bytes(run_dir)


def newest_good_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint a resume of this run dir would start from, verified (none: None)."""
    return find_good_checkpoint(run_dir, lambda message: None)


def resume_point(checkpoint: Path | None, step: int | None = None) -> str:
    """What is left to resume from after a failed save at `step`, in words."""
    if checkpoint is None:
        return "There is no good checkpoint to resume from: a rerun starts again from step 0."
    saved = int(checkpoint.name[5:])
    if saved == step:
        return (f"The newest good checkpoint, {checkpoint}, holds these weights (step {saved}): once there is space, "
                "the same command writes them out from it without training again.")
    return (f"The newest good checkpoint is {checkpoint} (step {saved}), intact: once there is space, the same "
            "command continues from it.")


def remove_stale_temps(run_dir: Path) -> None:
    """Half-written saves of a process that died (SIGKILL, power loss): never valid, safe to drop."""
    root = checkpoint_root(run_dir)
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(path, ignore_errors=True)


def save_weights(weights: dict, path: Path) -> None:
    """Write the unwrapped model's state dict atomically (temp file, fsync, rename); a failed write
    raises its OSError and leaves no temp file, and an existing `path` as it was."""
    write_atomically(path, lambda fh: torch.save(weights, fh))


def save_final_weights(weights: dict, run_dir: Path, step: int) -> None:
    """model.pt, for `sample` and `export`. When it cannot be written (a full disk), SaveFailed
    names the newest good checkpoint instead: the same command, rerun, resumes from it (at the
    last step it only writes model.pt)."""
    path = run_dir / FINAL_WEIGHTS
    try:
        save_weights(weights, path)
    except OSError as err:
        newest = newest_good_checkpoint(run_dir)
        why = describe_write_error(err, run_dir, tensor_bytes(weights), subject=FINAL_WEIGHTS)
        raise SaveFailed(f"the final weights could not be written to {path}: {why}. {resume_point(newest, step)}",
                         checkpoint=newest, run_dir=run_dir) from None
