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
(missing file, wrong size, wrong sha256) before anything is read, and `torch.load` runs with
`weights_only=True`: a checkpoint cannot execute code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from llmtrain.config import CheckpointConfig, SaveErrorPolicy
from llmtrain.errors import ConfigError, RunStopped, UserError
from llmtrain.shards import SHARDS

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
STATE_FILES = ("model.pt", "optimizer.pt", "rng.pt", "trainer_state.json")
SHARDED_FILES = ("optimizer.pt", "rng.pt", "trainer_state.json")  # + every file under shards/


class CheckpointError(UserError):
    """A checkpoint that cannot be used: names the folder, the file and what is wrong."""


class CheckpointSaveError(Exception):
    """A save that failed (disk full, permissions); the previous checkpoints are intact."""


@dataclass
class TrainState:
    """Everything the loop itself carries from step to step (the rest lives in the objects)."""

    step: int = 0  # optimizer steps taken (including skipped ones: their data was consumed)
    tokens: int = 0
    best_val_loss: float | None = None
    best_step: int | None = None
    lr_scale: float = 1.0  # cut by rollbacks
    rollbacks: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    alarm_skipped_steps: int = 0  # updates dropped by a health alarm's skip_step action


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
            from llmtrain.shards import read_full

            self.full_state = read_full(self.path / SHARDS, self.shards, self.device)
        return self.full_state

    def load_into(self, model: Any, optimizer: Any) -> None:
        """Weights and optimizer state into the run's objects: an FSDP2 model (its state objects
        from parallel.py) reads just its shards of a sharded checkpoint; anything else the whole."""
        from llmtrain.parallel import ShardedModelState, ShardedOptimizerState

        if self.sharded and isinstance(model, ShardedModelState) and isinstance(optimizer, ShardedOptimizerState):
            from llmtrain.shards import read_shards_into

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

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def _write_file(path: Path, write: Callable[[_HashingWriter], None]) -> dict[str, Any]:
    with open(path, "wb") as fh:
        writer = _HashingWriter(fh)
        write(writer)
        fh.flush()
        os.fsync(fh.fileno())
    return {"sha256": writer.sha256.hexdigest(), "bytes": writer.size}


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
        files["trainer_state.json"] = _write_file(tmp / "trainer_state.json", lambda f: f.write(json.dumps(trainer).encode()))
        manifest = {"format": FORMAT_VERSION, "step": state.step, "layout": "full" if shards is None else "sharded",
                    "files": files}
        _write_file(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=2).encode()))
        _fsync_dir(tmp)
        if final.exists():  # the same step again (after a rollback or a re-run): replace it whole
            old = root / f".old-{name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        _write_file(root / f".{LATEST}.tmp", lambda f: f.write(name.encode()))
        os.replace(root / f".{LATEST}.tmp", root / LATEST)
        _fsync_dir(root)
    except (OSError, RuntimeError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(f"could not save checkpoint {final}: {err}") from err
    return final


def remove_stale_temps(run_dir: Path) -> None:
    """Half-written saves of a process that died (SIGKILL, power loss): never valid, safe to drop."""
    root = checkpoint_root(run_dir)
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(path, ignore_errors=True)


def apply_retention(run_dir: Path, keep_last: int, keep_step: int | None = None) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints and the one of `keep_step` (the best)."""
    checkpoints = list_checkpoints(run_dir)
    keep = set(checkpoints[:keep_last])
    if keep_step is not None:
        keep |= {p for p in checkpoints if p.name == step_dir_name(keep_step)}
    removed = []
    for path in checkpoints:
        if path not in keep:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class _Held:
    """A state dict read already, handed on as if from its object."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state


class CheckpointPolicy:
    """When to save (every N steps / M minutes), what to keep, and what a failed save does."""

    def __init__(
        self, policy: CheckpointConfig, run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None, sampler: Any, config_dict: dict,
        metrics: Any, warn: Callable[[str], None], extra_state: Callable[[], dict] = dict, writer: bool = True,
        agree: Callable[[Any], Any] = lambda value: value, shard_layout: tuple[int, int] | None = None,
    ) -> None:
        # sampler: anything with state_dict(); metrics: anything with write(record) (a JsonlSink).
        # writer=False (DDP ranks but 0): the same decisions, nothing written (rank 0 saves the state).
        self.writer = writer
        # agree(value): rank 0's value on every rank, so all ranks know whether a save succeeded
        # (the final save after the loop is a collective under ZeRO-1/FSDP2: all or none retry it).
        self.agree = agree
        # (rank, world size): sharded files, every rank writing its own shards (model and optimizer
        # are then parallel.py's ShardedModelState / ShardedOptimizerState).
        self.shard_layout = shard_layout
        self.policy, self.run_dir = policy, run_dir
        self.model, self.optimizer, self.scaler, self.sampler = model, optimizer, scaler, sampler
        self.config_dict, self.metrics, self.warn = config_dict, metrics, warn
        self.extra_state = extra_state  # more JSON state to keep (the health monitor's)
        self.last_saved_step: int | None = None
        self.last_saved_time = time.monotonic()
        self.last_val: tuple[int, float] | None = None  # (step, val loss) of the latest evaluation

    def due(self, step: int) -> bool:
        by_steps = self.policy.every_steps is not None and step % self.policy.every_steps == 0
        by_time = self.policy.every_minutes is not None and time.monotonic() - self.last_saved_time >= 60 * self.policy.every_minutes
        return by_steps or by_time

    def save(self, state: TrainState) -> Path | None:
        """Save on every rank (a collective under ZeRO-1/FSDP2); the path on the writing rank."""
        if self.last_val is not None and self.last_val[0] == state.step and self.policy.keep_best:
            if state.best_val_loss is None or self.last_val[1] < state.best_val_loss:
                state.best_val_loss, state.best_step = self.last_val[1], state.step
        began = time.perf_counter()
        path, error = None, None
        try:
            if self.shard_layout is not None:
                path = self._save_sharded(state)
            else:
                # On every rank: under ZeRO-1/FSDP2 reading the full state gathers the shards.
                model_state, optimizer_state = self.model.state_dict(), self.optimizer.state_dict()
                if self.writer:
                    path = self._write(state, model=_Held(model_state), optimizer=_Held(optimizer_state))
        except CheckpointSaveError as err:
            error = str(err)
        # Rank 0's outcome decides for all: every rank then stops, warns or records the same save.
        error = self.agree(error)
        self.last_saved_time = time.monotonic()  # retry at the next due time, not at every step
        if error is not None:
            self.metrics.write({"kind": "checkpoint_error", "step": state.step, "error": error})
            if self.policy.on_save_error is SaveErrorPolicy.stop:
                raise RunStopped(f"{error}; stopping (checkpoint.on_save_error=stop)", run_dir=self.run_dir)
            self.warn(f"{error}; training goes on, the previous checkpoints are intact (checkpoint.on_save_error=warn)")
            return None
        self.last_saved_step = state.step
        if self.writer:
            removed = apply_retention(self.run_dir, self.policy.keep_last, state.best_step if self.policy.keep_best else None)
            self.metrics.write({"kind": "checkpoint", "step": state.step, "path": str(path),
                                "seconds": time.perf_counter() - began, "removed": [p.name for p in removed]})
        return path

    def _write(self, state: TrainState, **tensors: Any) -> Path:
        return save_checkpoint(
            self.run_dir, scaler=self.scaler, sampler_state=self.sampler.state_dict(), state=state,
            config=self.config_dict, extra=self.extra_state(), **tensors,
        )

    def _save_sharded(self, state: TrainState) -> Path | None:
        """Every rank writes its shards into the folder rank 0 staged, and hashes a share of the
        files; rank 0 then writes the rest (optimizer groups, RNG, trainer state, manifest) and
        renames the folder into place. A failure anywhere leaves the previous checkpoints as they were."""
        from torch.distributed.checkpoint.api import CheckpointException

        from llmtrain.shards import ERROR_KEY, all_gather_dicts, hash_files, write_shards

        rank, world_size = self.shard_layout
        staged, error = None, None
        if self.writer:
            try:
                staged = staging_dir(self.run_dir, state.step)
            except OSError as err:
                error = f"could not save checkpoint {checkpoint_root(self.run_dir) / step_dir_name(state.step)}: {err}"
        staged, error = self.agree((staged, error))
        if staged is None:
            raise CheckpointSaveError(error)
        def failed(err: object) -> CheckpointSaveError:
            if self.writer:
                shutil.rmtree(staged, ignore_errors=True)
            return CheckpointSaveError(f"could not save the shards of checkpoint {staged}: {err}")

        try:
            non_tensor = write_shards(staged / SHARDS, self.model.model, self.optimizer.optimizer)
        except (OSError, RuntimeError, CheckpointException) as err:  # DCP raises on every rank
            raise failed(err) from None
        # A rank that cannot hash its share still joins the gather (with its error), or the
        # others would wait in it forever; then every rank fails the save together.
        try:
            share = hash_files(staged / SHARDS, rank, world_size)
        except OSError as err:
            share = {ERROR_KEY: f"rank {rank}: {err}"}
        files = all_gather_dicts(share, world_size)
        if ERROR_KEY in files:
            raise failed(files[ERROR_KEY])
        files = dict(sorted(files.items()))
        if not self.writer:
            return None
        return self._write(state, model=None, optimizer=None, staged=staged,
                           shards={"files": files, "non_tensor": non_tensor})


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
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{path}: {MANIFEST} is missing or unreadable ({err})") from None
    sharded = manifest.get("layout") == "sharded"
    required = SHARDED_FILES + (f"{SHARDS}/.metadata",) if sharded else STATE_FILES
    for name in required:
        if name not in files:
            raise CheckpointError(f"{path}: the manifest does not list {name}")
    for name, entry in files.items():
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
    return manifest


def _candidates(run_dir: Path) -> list[Path]:
    """Checkpoints to try, best first: the one `latest` names (it finished last), then newest first."""
    root = checkpoint_root(run_dir)
    ordered = list_checkpoints(run_dir)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named.is_dir():
            ordered = [named] + [p for p in ordered if p != named]
    return ordered


def _first_good(run_dir: Path, attempt: Callable[[Path], Any], warn: Callable[[str], None]) -> Any:
    for path in _candidates(run_dir):
        try:
            return attempt(path)
        except CheckpointError as err:
            warn(f"checkpoint unusable ({err}); trying an older one")
    return None


def find_good_checkpoint(run_dir: Path, warn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint that verifies; every bad one passed over is reported through `warn`."""
    return _first_good(run_dir, lambda path: verify(path) and path, warn)


def load_newest_good(run_dir: Path, warn: Callable[[str], None], device: torch.device | str = "cpu") -> Checkpoint | None:
    """The newest checkpoint that verifies, loaded (each file is hashed once)."""
    return _first_good(run_dir, lambda path: load_checkpoint(path, device), warn)


def load_checkpoint(path: Path, device: torch.device | str = "cpu", verify_files: bool = True) -> Checkpoint:
    """Verify and read a checkpoint folder (weights_only: a checkpoint cannot run code).
    `verify_files=False`: the folder was verified just now (by find_good_checkpoint, or by rank 0
    for all ranks); its files are not hashed again."""
    manifest = verify(path) if verify_files else json.loads((path / MANIFEST).read_text())
    trainer = json.loads((path / "trainer_state.json").read_text())
    if trainer.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {trainer.get('format')} is not {FORMAT_VERSION}, which this llmtrain reads")
    opt = torch.load(path / "optimizer.pt", map_location=device, weights_only=True)
    rng = torch.load(path / "rng.pt", map_location="cpu", weights_only=True)
    if manifest.get("layout") == "sharded":  # tensors read when asked for (each rank its shards, or whole)
        return Checkpoint(path, None, opt["scaler"], rng, trainer, shards=opt["shards"], device=device)
    model = torch.load(path / "model.pt", map_location=device, weights_only=True)
    return Checkpoint(path, (model, opt["optimizer"]), opt["scaler"], rng, trainer, device=device)


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The whole model state_dict of a verified checkpoint folder, in either layout, on the CPU
    (of a sharded one, the weights alone: not the optimizer's moments)."""
    checkpoint = load_checkpoint(path)
    if checkpoint.sharded:
        from llmtrain.shards import read_full

        return read_full(path / SHARDS, checkpoint.shards, model_only=True)[0]
    return checkpoint.model


def resume_checkpoint(
    resume: str, run_dir: Path, warn: Callable[[str], None], device: torch.device | str = "cpu"
) -> Checkpoint | None:
    """The checkpoint `resume=` asks for, loaded: auto (this run dir's newest good one), never, or a path."""
    if resume == "never":
        if list_checkpoints(run_dir):
            raise ConfigError(
                f"resume=never, but {checkpoint_root(run_dir)} already holds checkpoints that a fresh run would "
                "overwrite; use resume=auto to continue it, or another run dir (hydra.run.dir=...)."
            )
        return None
    if resume == "auto":
        return load_newest_good(run_dir, warn, device)
    path = Path(resume).expanduser()
    if (path / MANIFEST).is_file():
        return load_checkpoint(path, device)
    if checkpoint_root(path).is_dir():
        found = load_newest_good(path, warn, device)
        if found is None:
            raise ConfigError(f"resume='{resume}': no usable checkpoint in {checkpoint_root(path)}.")
        return found
    raise ConfigError(
        f"resume='{resume}' is neither a checkpoint folder (with {MANIFEST}) nor a run dir with {CHECKPOINTS}/; "
        "valid: auto, never, or such a path."
    )


# Keys whose change makes saved tensors or optimizer state meaningless for the new run.
SHAPE_KEYS = (
    "model.n_layer", "model.n_head", "model.n_embd", "model.block_size", "model.vocab_size", "model.bias",
    "model.tie_weights", "model.position", "model.norm", "model.mlp", "model.mlp_ratio", "model.norm_position",
    "data.source", "data.path", "data.tokenizer", "data.bpe_vocab_size", "data.text_field", "data.sampling",
    "data.hf_name", "data.hf_config", "data.hf_split", "optim.name", "optim.decay_embeddings",
)
# Keys that never matter for resuming.
IGNORED_KEYS = ("out_dir", "resume")


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for every key that differs, ignored keys left out."""
    old, new = _flatten(saved), _flatten(current)
    keys = sorted(set(old) | set(new))
    return [(k, old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k) and k not in IGNORED_KEYS]
