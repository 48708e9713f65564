"""Writing full-state checkpoints: atomic, verified, and exact enough to resume bit for bit
(checkpoint/layout.py says what one holds; read.py reads it back).

A checkpoint is written into a hidden temporary folder, every file fsync'ed, then renamed into
place, so a crash mid-save leaves the previous checkpoints untouched; the manifest (sha256 and size
of every file) is written last. A save that fails names the cause (a full disk: how much was free
and how much was needed) and leaves the previous checkpoints as they were. The run's final weights
(model.pt) are written here too.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import platform
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmtrain.checkpoint.layout import (
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    checkpoint_root,
    step_dir_name,
)
from llmtrain.checkpoint.read import find_good_checkpoint, list_checkpoints
from llmtrain.core.atomic import fsync_dir, swap_folder, write_atomically, write_file
from llmtrain.core.errors import (
    CheckpointSaveError,
    SaveFailed,
)
from llmtrain.core.files import FINAL_WEIGHTS, TRAINER_STATE
from llmtrain.engine.state import TrainState

# ---------------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------------


def _mb(n_bytes: float) -> str:
    return f"{n_bytes / 1e6:,.1f} MB"


def _existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mount_point(path: Path) -> Path:
    """The mount point of the file system `path` is (or would be) on."""
    path = _existing(path)
    while not os.path.ismount(path):
        path = path.parent
    return path


def os_error_of(err: BaseException) -> OSError | None:
    """The OSError behind a failed write: `err` itself, the one torch or torch.distributed.checkpoint
    (a CheckpointException's per-rank failures) wrapped, or None."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError):
            return err
        for failure in (getattr(err, "failures", None) or {}).values():  # DCP: {rank: (exception, trace)}
            found = os_error_of(failure[0] if isinstance(failure, tuple) else failure)
            if found is not None:
                return found
        err = err.__cause__ or err.__context__
    return None


def describe_write_error(err: BaseException, where: Path, needed: int | None, subject: str = "the checkpoint") -> str:
    """A failed write in words. A full disk or quota names the file system, the space `subject`
    needs (`needed` bytes, an estimate) and the space free; other OSErrors keep errno text and path."""
    os_error = os_error_of(err)
    if os_error is None:
        return f"{type(err).__name__}: {' '.join(str(err).split())}"
    if os_error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return str(os_error)
    what = "no space left" if os_error.errno == errno.ENOSPC else "disk quota exceeded"
    try:
        free = _mb(shutil.disk_usage(_existing(where)).free)
    except OSError:
        free = "an unknown amount"
    need = f"needs ~{_mb(needed)}" if needed else "does not fit"
    file = f" writing {os_error.filename}" if os_error.filename else ""
    return (f"{what} on {mount_point(where)} ({errno.errorcode[os_error.errno]}): {subject} {need}, {free} free "
            f"({os_error.strerror}{file})")


def tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors in a (nested) state dict: what saving it writes, give or take a little."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(value) for value in tree)
    return 0


def checkpoint_bytes(path: Path) -> int | None:
    """The size of a checkpoint folder as its manifest lists it (None: no readable manifest)."""
    try:
        return sum(entry["bytes"] for entry in json.loads((path / MANIFEST).read_text())["files"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def rng_snapshot() -> tuple[dict, dict]:
    """(tensor states for rng.pt, JSON-able states for trainer_state.json)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state_all()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    plain = {
        "python": [version, list(py_state), py_gauss],
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
    }
    return tensors, plain


def restore_rng(tensors: dict, plain: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda"])
    version, py_state, py_gauss = plain["python"]
    random.setstate((version, tuple(py_state), py_gauss))
    kind, keys, pos, has_gauss, gauss = plain["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


def staging_dir(run_dir: Path, step: int) -> Path:
    """A fresh hidden folder to write a checkpoint of `step` into (renamed into place when whole)."""
    root = checkpoint_root(run_dir)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def save_checkpoint(
    run_dir: Path,
    *,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scaler: torch.amp.GradScaler | None,
    sampler_state: dict,
    state: TrainState,
    config: dict,
    extra: dict | None = None,
    staged: Path | None = None,
    shards: dict | None = None,
) -> Path:
    """Write a checkpoint of the current step atomically; raises CheckpointSaveError on failure.

    Sharded layout: the ranks already wrote shards/ into `staged` (from staging_dir); `shards` is
    {"files": manifest entries of those files, "non_tensor": the optimizer's groups and plain state};
    model and optimizer are not used."""
    root = checkpoint_root(run_dir)
    name = step_dir_name(state.step)
    final = root / name
    tmp = staged or root / f".tmp-{name}-{os.getpid()}"
    latest_tmp = root / f".{LATEST}.tmp"
    try:
        if staged is None:
            tmp = staging_dir(run_dir, state.step)
        rng_tensors, rng_plain = rng_snapshot()
        trainer = {
            "format": FORMAT_VERSION,
            "state": dataclasses.asdict(state),
            "sampler": sampler_state,
            "rng": rng_plain,
            "config": config,
            "versions": {"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version()},
            "saved_at": time.time(),
            **(extra or {}),
        }
        scaler_state = scaler.state_dict() if scaler else None
        if shards is None:
            files = {
                "model.pt": write_file(tmp / "model.pt", lambda f: torch.save(model.state_dict(), f)),
                "optimizer.pt": write_file(
                    tmp / "optimizer.pt", lambda f: torch.save({"optimizer": optimizer.state_dict(), "scaler": scaler_state}, f)
                ),
            }
        else:
            files = {
                **shards["files"],
                "optimizer.pt": write_file(
                    tmp / "optimizer.pt", lambda f: torch.save({"shards": shards["non_tensor"], "scaler": scaler_state}, f)
                ),
            }
        files["rng.pt"] = write_file(tmp / "rng.pt", lambda f: torch.save(rng_tensors, f))
        files[TRAINER_STATE] = write_file(tmp / TRAINER_STATE, lambda f: f.write(json.dumps(trainer).encode()))
        manifest = {"format": FORMAT_VERSION, "step": state.step, "layout": "full" if shards is None else "sharded",
                    "files": files}
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
        needed = _needed_bytes(run_dir, model, optimizer, shards)
        raise CheckpointSaveError(f"could not save checkpoint {final}: {describe_write_error(err, root, needed)}") from err
    return final


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


def _needed_bytes(run_dir: Path, model: Any, optimizer: Any, shards: dict | None) -> int | None:
    """About what a checkpoint takes: the bytes of its tensors, else the newest checkpoint's size."""
    try:
        if shards is not None:
            return sum(entry["bytes"] for entry in shards["files"].values()) + tensor_bytes(shards["non_tensor"])
        if model is not None and optimizer is not None:
            return tensor_bytes(model.state_dict()) + tensor_bytes(optimizer.state_dict())
    except Exception:  # noqa: BLE001 - only an estimate for a message; the previous size will do
        pass
    return previous_checkpoint_bytes(run_dir)


def previous_checkpoint_bytes(run_dir: Path) -> int | None:
    """The size of the newest checkpoint with a readable manifest (None: there is none)."""
    for path in list_checkpoints(run_dir):
        size = checkpoint_bytes(path)
        if size is not None:
            return size
    return None


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
