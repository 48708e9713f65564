"""Full-state checkpoints: atomic, verified, and exact enough to resume bit for bit.

Layout of a run dir:

    checkpoints/
      step_00000250/          one checkpoint, taken at an optimizer-step boundary
        model.pt              the unwrapped model's state_dict
        optimizer.pt          optimizer (+ fp16 loss-scaler) state
        rng.pt                torch CPU (and CUDA) generator states
        trainer_state.json    step, tokens, data-sampler position, Python/NumPy RNG, policy
                              counters, best validation loss, the resolved config, versions
        manifest.json         sha256 and size of every file above; written last
      latest                  the newest checkpoint's folder name; replaced last

Under parallel=fsdp (checkpoint.format=auto or sharded) model.pt and the optimizer's tensors are
replaced by `shards/`, which every rank writes its own part of (torch.distributed.checkpoint, see
shards.py); optimizer.pt then holds the optimizer's parameter groups and the loss scaler. Either
layout resumes in any parallel mode and world size.

A checkpoint is written into a hidden temporary folder, every file fsync'ed, then renamed into
place, so a crash mid-save leaves the previous checkpoints untouched. Loading checks the manifest
(missing file, wrong size, wrong sha256) before anything is read, `torch.load` runs with
`weights_only=True` and a sharded checkpoint's DCP metadata goes through a restricted unpickler
(shards.read_metadata): a checkpoint cannot execute code. Any file that still fails to load makes
the checkpoint damaged (CheckpointError), passed over for an older one.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from llmtrain.checkpoint.shards import SHARDS
from llmtrain.distributed.wrapping import (
    ShardedModelState,
    ShardedOptimizerState,
)
from llmtrain.errors import (
    CheckpointError,
    CheckpointSaveError,
    SaveFailed,
)
from llmtrain.runs.files import CHECKPOINTS, FINAL_WEIGHTS, TRAINER_STATE
from llmtrain.training.state import TrainState

FORMAT_VERSION = 1


LATEST = "latest"


MANIFEST = "manifest.json"


STATE_FILES = ("model.pt", "optimizer.pt", "rng.pt", TRAINER_STATE)


SHARDED_FILES = ("optimizer.pt", "rng.pt", TRAINER_STATE)  # + every file under shards/


@dataclass
class Checkpoint:
    """A verified checkpoint read back from disk. The tensors of a sharded one are read only when
    asked for: whole through `model`/`optimizer`, or each rank its shards through `load_into`."""

    path: Path
    full_state: tuple[dict[str, torch.Tensor], dict] | None  # (model, optimizer); None: not read yet
    scaler: dict | None
    rng: dict
    trainer: dict  # trainer_state.json
    shards: dict | None = None  # sharded layout: optimizer.pt's non-tensor part (shards.py)
    device: torch.device | str = "cpu"
    state: TrainState = field(init=False)

    def __post_init__(self) -> None:
        self.state = TrainState(**self.trainer["state"])

    @property
    def sharded(self) -> bool:
        return self.shards is not None

    @property
    def model(self) -> dict[str, torch.Tensor]:
        return self._full()[0]

    @property
    def optimizer(self) -> dict:
        return self._full()[1]

    def _full(self) -> tuple[dict[str, torch.Tensor], dict]:
        if self.full_state is None:
            from llmtrain.checkpoint.shards import read_full

            self.full_state = read_full(self.path / SHARDS, self.shards, self.device)
        return self.full_state

    def load_into(self, model: Any, optimizer: Any) -> None:
        """Weights and optimizer state into the run's objects: an FSDP2 model (its state objects
        from distributed/wrapping.py) reads just its shards of a sharded checkpoint; anything else the whole."""

        if self.sharded and isinstance(model, ShardedModelState) and isinstance(optimizer, ShardedOptimizerState):
            from llmtrain.checkpoint.shards import read_shards_into

            read_shards_into(self.path / SHARDS, model.model, optimizer.optimizer, self.shards)
            return
        model.load_state_dict(self.model)
        optimizer.load_state_dict(self.optimizer)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


# ---------------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------------


class _HashingWriter:
    """A file wrapper that hashes what passes through, so nothing is read back to hash it."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.sha256 = hashlib.sha256()
        self.size = 0
        # The first failed write. torch's zip writer swallows it and raises its own RuntimeError
        # ("[enforce fail at inline_container.cc] unexpected pos ..."), which names neither the
        # errno nor the file: _write_file reports this one instead.
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            written = self.fh.write(data)
        except OSError as err:
            self.error = self.error or err
            raise
        self.sha256.update(data)
        self.size += len(data)
        return written

    def flush(self) -> None:
        self.fh.flush()


def _write_file(path: Path, write: Callable[[_HashingWriter], None]) -> dict[str, Any]:
    """Write, flush and fsync one file; a failed write raises its OSError, naming `path`."""
    writer = None
    try:
        with open(path, "wb") as fh:
            writer = _HashingWriter(fh)
            write(writer)
            fh.flush()
            os.fsync(fh.fileno())
    except (OSError, RuntimeError) as err:
        cause = writer.error if writer is not None and writer.error is not None else err
        if not isinstance(cause, OSError):
            raise
        if cause.filename is None:  # a file object's write() does not say which file it was
            raise OSError(cause.errno, cause.strerror, str(path)) from err
        if cause is err:
            raise
        raise cause from err
    return {"sha256": writer.sha256.hexdigest(), "bytes": writer.size}


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` whole or not at all: into a temp file beside it, fsync'ed, then renamed over
    it. On failure the temp file is removed and an existing `path` is left as it was."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        _write_file(tmp, write)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
                "model.pt": _write_file(tmp / "model.pt", lambda f: torch.save(model.state_dict(), f)),
                "optimizer.pt": _write_file(
                    tmp / "optimizer.pt", lambda f: torch.save({"optimizer": optimizer.state_dict(), "scaler": scaler_state}, f)
                ),
            }
        else:
            files = {
                **shards["files"],
                "optimizer.pt": _write_file(
                    tmp / "optimizer.pt", lambda f: torch.save({"shards": shards["non_tensor"], "scaler": scaler_state}, f)
                ),
            }
        files["rng.pt"] = _write_file(tmp / "rng.pt", lambda f: torch.save(rng_tensors, f))
        files[TRAINER_STATE] = _write_file(tmp / TRAINER_STATE, lambda f: f.write(json.dumps(trainer).encode()))
        manifest = {"format": FORMAT_VERSION, "step": state.step, "layout": "full" if shards is None else "sharded",
                    "files": files}
        _write_file(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=2).encode()))
        _fsync_dir(tmp)
        # The new `latest` is written before the rename: every byte of the save lands before the
        # checkpoint is in place, so a full disk fails the save with nothing half-done (renames
        # need no space).
        _write_file(latest_tmp, lambda f: f.write(name.encode()))
        if final.exists():  # the same step again (after a rollback or a re-run): replace it whole
            old = root / f".old-{name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        os.replace(latest_tmp, root / LATEST)
        _fsync_dir(root)
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


# ---------------------------------------------------------------------------------------------
# finding, verifying, loading
# ---------------------------------------------------------------------------------------------


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint folders of a run dir, newest step first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def verify(path: Path) -> dict:
    """Check every file against the manifest (returned); raises CheckpointError naming the bad file."""
    manifest = read_manifest(path)
    files = manifest["files"]
    sharded = manifest.get("layout") == "sharded"
    required = SHARDED_FILES + (f"{SHARDS}/.metadata",) if sharded else STATE_FILES
    for name in required:
        if name not in files:
            raise CheckpointError(f"{path}: the manifest does not list {name}")
    for name, entry in files.items():
        check_file(path, name, entry)
    return manifest


def read_manifest(path: Path) -> dict:
    """A checkpoint's manifest.json, its file table checked for form (the files themselves are not
    looked at); CheckpointError when it is missing, unreadable or malformed."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict) or not all(isinstance(e, dict) and _is_size(e.get("bytes")) and
                                                  isinstance(e.get("sha256"), str) for e in files.values()):
            raise ValueError("its file table is malformed")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: {MANIFEST} is missing or unreadable ({err})") from None
    return manifest


def check_file(path: Path, name: str, entry: dict) -> None:
    """One file of checkpoint `path` against its manifest entry: inside the folder, there, of the
    listed size and sha256; CheckpointError naming it otherwise."""
    if Path(name).is_absolute() or ".." in Path(name).parts:  # only files inside the folder are read
        raise CheckpointError(f"{path}: the manifest lists {name!r}, which is not inside the checkpoint folder")
    target = path / name
    if not target.is_file():
        raise CheckpointError(f"{path}: {name} is missing")
    size = target.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"{path}: {name} is {size} bytes, the manifest says {entry['bytes']} (truncated?)")
    digest = hashlib.sha256()
    with open(target, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    if digest.hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{path}: {name} does not match its sha256 in the manifest (corrupted)")


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _candidates(run_dir: Path) -> list[Path]:
    """Checkpoints to try, best first: the one `latest` names (it finished last), then newest first.
    `latest` may only name one of the run's own checkpoint folders."""
    root = checkpoint_root(run_dir)
    ordered = list_checkpoints(run_dir)
    try:
        named = root / (root / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, ValueError):  # no pointer, or an unreadable one: newest first
        return ordered
    if named in ordered:
        ordered = [named] + [p for p in ordered if p != named]
    return ordered


def _first_good(run_dir: Path, attempt: Callable[[Path], Any], warn: Callable[[str], None],
                failures: list[str] | None = None) -> Any:
    """attempt(checkpoint) of the first candidate for which it raises no CheckpointError (None: no
    such one); each one passed over is warned about and, given `failures`, described there."""
    for path in _candidates(run_dir):
        try:
            return attempt(path)
        except CheckpointError as err:
            warn(f"checkpoint unusable ({err}); trying an older one")
            if failures is not None:
                failures.append(str(err))
    return None


def first_good_checkpoint(run_dir: Path, attempt: Callable[[Path], Any], warn: Callable[[str], None],
                          failures: list[str] | None = None) -> Any:
    """attempt(checkpoint) for the run dir's checkpoints, best first, until one raises no
    CheckpointError: its result (None: every one did, or there are none). Each failure is warned
    about and, given `failures`, described there."""
    return _first_good(run_dir, attempt, warn, failures)


def find_good_checkpoint(run_dir: Path, warn: Callable[[str], None], readable: bool = False) -> Path | None:
    """The newest checkpoint that verifies; every bad one passed over is reported through `warn`.
    `readable`: also read every file of it (not its shards' tensors), so that a file that hashes
    right but cannot be loaded (a forged one) is passed over too."""
    if readable:
        return _first_good(run_dir, lambda path: load_checkpoint(path).path, warn)
    return _first_good(run_dir, lambda path: verify(path) and path, warn)


def load_newest_good(run_dir: Path, warn: Callable[[str], None], device: torch.device | str = "cpu",
                     failures: list[str] | None = None) -> Checkpoint | None:
    """The newest checkpoint that verifies and reads, loaded (each file is hashed once)."""
    return _first_good(run_dir, lambda path: load_checkpoint(path, device), warn, failures)


# Lines of torch.load's weights_only refusal that are advice, not the reason (it advises loading the
# file with weights_only=False, which would run whatever code it holds).
_ADVICE = ("Weights only load failed", "weights_only", "Please file an issue", "Check the documentation",
           "trusted source")


def damaged(path: Path, name: str, err: BaseException) -> CheckpointError:
    """A file of a checkpoint that cannot be loaded, as a CheckpointError naming it: the reason in
    a few words, never torch's advice to load it with weights_only=False."""
    text = str(err).strip()
    detail = " ".join(line.strip() for line in text.splitlines() if line.strip() and not any(a in line for a in _ADVICE))
    detail = detail.replace("WeightsUnpickler error:", "").strip()
    if "Weights only load failed" in text:  # weights_only met what is not a tensor or plain data
        named = re.search(r"GLOBAL (\S+)", detail)
        what = (f"a reference to {named.group(1)} (code, not data)" if named
                else f"something other than tensors and plain data ({detail[:200] or 'no reason given'})")
        reason = f"it holds {what}; llmtrain never writes that and does not load it, since loading it could run code"
    else:
        reason = f"{type(err).__name__}: {detail[:300]}" if detail else f"{type(err).__name__}; the file is damaged"
    return CheckpointError(f"{path}: {name} cannot be read ({reason})")


def _torch_file(path: Path, name: str, device: torch.device | str) -> Any:
    try:
        return torch.load(path / name, map_location=device, weights_only=True)
    except Exception as err:  # noqa: BLE001 - whatever a damaged file raises, it is a damaged checkpoint
        raise damaged(path, name, err) from None


def _expect(ok: bool, path: Path, name: str, what: str) -> None:
    if not ok:
        raise CheckpointError(f"{path}: {name} is not what llmtrain writes there ({what})")


def is_state_dict(value: Any) -> bool:
    """A model state_dict as torch.save writes one: tensors by parameter name."""
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())


def read_weights_file(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A model.pt (a run's final weights, or a checkpoint's), weights_only; CheckpointError naming
    the file when it cannot be read or holds no state_dict."""
    weights = _torch_file(path.parent, path.name, device)
    _expect(is_state_dict(weights), path.parent, path.name, "a dict of tensors by parameter name")
    return weights


def _check_rng(path: Path, tensors: Any, plain: Any) -> None:
    """The RNG states are tried on throw-away generators now, so a bad one is a damaged checkpoint
    here rather than a crash after the model is built."""
    try:
        torch.Generator().set_state(tensors["torch"])
        version, py_state, py_gauss = plain["python"]
        random.Random().setstate((version, tuple(py_state), py_gauss))
        kind, keys, pos, has_gauss, gauss = plain["numpy"]
        np.random.RandomState().set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    except Exception as err:  # noqa: BLE001 - any malformed state: the checkpoint is damaged
        raise CheckpointError(f"{path}: its RNG states (rng.pt, trainer_state.json) cannot be restored "
                              f"({type(err).__name__}: {str(err)[:200]})") from None


def _trainer_state(path: Path) -> dict:
    name = TRAINER_STATE
    try:
        trainer = json.loads((path / name).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: {name} cannot be read ({type(err).__name__}: {str(err)[:200]})") from None
    _expect(isinstance(trainer, dict), path, name, "a JSON object")
    if trainer.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {trainer.get('format')} is not {FORMAT_VERSION}, which this llmtrain reads")
    for key in ("state", "sampler", "rng", "config"):
        _expect(isinstance(trainer.get(key), dict), path, name, f"'{key}' is not an object")
    fields = {f.name for f in dataclasses.fields(TrainState)}
    _expect(set(trainer["state"]) <= fields, path, name, f"'state' has keys other than {', '.join(sorted(fields))}")
    _expect(all(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
                for value in trainer["state"].values()), path, name, "'state' holds a value that is not a number")
    _check_state_values(path, trainer["state"])
    return trainer


# TrainState's counts (non-negative integers) and the values a run can reach for the others.
_COUNTS = ("step", "tokens", "rollbacks", "skipped_steps", "consecutive_skips", "alarm_skipped_steps")


def _check_state_values(path: Path, state: dict) -> None:
    """Each TrainState value is one a run can have reached, and the step is the folder's own
    (step_00000004 holds step 4): a forged step of 10**30 would resume a run past its end."""
    bad = [key for key in _COUNTS if key in state and (not isinstance(state[key], int) or state[key] < 0)]
    if state.get("best_step") is not None and (not isinstance(state["best_step"], int) or state["best_step"] < 0):
        bad.append("best_step")
    if "lr_scale" in state and not (isinstance(state["lr_scale"], (int, float)) and 0 < state["lr_scale"] <= 1):
        bad.append("lr_scale")
    if state.get("best_val_loss") is not None and not math.isfinite(state["best_val_loss"]):
        bad.append("best_val_loss")
    bad = [f"{key} {state[key]!r}" for key in bad]
    _expect(not bad, path, TRAINER_STATE, f"values a run cannot reach in 'state' ({', '.join(bad[:3])})")
    named = re.fullmatch(r"step_(\d+)", path.name)
    _expect(named is None or state.get("step") == int(named.group(1)), path, TRAINER_STATE,
            f"step {state.get('step')!r} in 'state', not the folder's step {int(named.group(1)) if named else ''}")


def load_checkpoint(path: Path, device: torch.device | str = "cpu", verify_files: bool = True) -> Checkpoint:
    """Verify and read a checkpoint folder (weights_only: a checkpoint cannot run code). Whatever
    is wrong with a file (damaged, forged, another program's) raises CheckpointError naming it.
    `verify_files=False`: the folder was verified just now (by find_good_checkpoint, or by rank 0
    for all ranks); its files are not hashed again."""
    if verify_files:
        manifest = verify(path)
    else:
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{path}: {MANIFEST} is missing or unreadable ({err})") from None
    trainer = _trainer_state(path)
    sharded = isinstance(manifest, dict) and manifest.get("layout") == "sharded"
    opt = _torch_file(path, "optimizer.pt", device)
    keys = ("shards", "scaler") if sharded else ("optimizer", "scaler")
    _expect(isinstance(opt, dict) and all(k in opt for k in keys), path, "optimizer.pt", f"a dict of {' and '.join(keys)}")
    _expect(opt["scaler"] is None or isinstance(opt["scaler"], dict), path, "optimizer.pt", "the loss scaler is no dict")
    rng = _torch_file(path, "rng.pt", "cpu")
    _expect(isinstance(rng, dict) and isinstance(rng.get("torch"), torch.Tensor), path, "rng.pt", "a dict of RNG tensors")
    _check_rng(path, rng, trainer["rng"])
    try:
        if sharded:  # tensors read when asked for (each rank its shards, or whole); the metadata now
            from llmtrain.checkpoint.shards import saved_keys

            shards = opt["shards"]
            _expect(isinstance(shards, dict) and isinstance(shards.get("param_groups"), list)
                    and isinstance(shards.get("plain_state"), dict), path, "optimizer.pt", "the shards' groups")
            saved_keys(path / SHARDS)  # the restricted unpickler: a forged .metadata is refused here
            return Checkpoint(path, None, opt["scaler"], rng, trainer, shards=shards, device=device)
        model = read_weights_file(path / "model.pt", device)
        optimizer = opt["optimizer"]
        _expect(isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict)
                and isinstance(optimizer.get("param_groups"), list), path, "optimizer.pt", "an optimizer state_dict")
        return Checkpoint(path, (model, optimizer), opt["scaler"], rng, trainer, device=device)
    except TypeError as err:  # TrainState(**state): a value of the wrong kind
        raise CheckpointError(f"{path}: trainer_state.json cannot be used ({err})") from None


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The whole model state_dict of a checkpoint folder, in either layout, on the CPU. Only the
    files that hold the weights are read (model.pt, or shards/ of a sharded one: not the optimizer's
    state, the RNG or the trainer state, which sampling and export never use), each checked against
    the manifest's sha256 once before it is loaded; CheckpointError naming a bad one."""
    manifest = read_manifest(path)
    files = manifest["files"]
    if manifest.get("layout") == "sharded":
        if f"{SHARDS}/.metadata" not in files:
            raise CheckpointError(f"{path}: the manifest does not list {SHARDS}/.metadata")
        for name, entry in files.items():
            if Path(name).parts[:1] == (SHARDS,):  # model and optimizer tensors share these files
                check_file(path, name, entry)
        from llmtrain.checkpoint.shards import read_full

        return read_full(path / SHARDS, {}, model_only=True)[0]
    if "model.pt" not in files:
        raise CheckpointError(f"{path}: the manifest does not list model.pt")
    check_file(path, "model.pt", files["model.pt"])
    return read_weights_file(path / "model.pt")


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
