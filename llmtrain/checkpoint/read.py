"""Finding, verifying and loading checkpoints (checkpoint/layout.py says what one is).

Loading checks the manifest (missing file, wrong size, wrong sha256) before anything is read,
`torch.load` runs with `weights_only=True` and a sharded checkpoint's DCP metadata goes through a
restricted unpickler (shards.read_metadata): a checkpoint cannot execute code. trainer_state.json
must hold values a run can reach, its step the folder's own. Any file that still fails to load
makes the checkpoint damaged (CheckpointError), passed over for an older one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmtrain.checkpoint.layout import (
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    SHARDED_FILES,
    STATE_FILES,
    Checkpoint,
    checkpoint_root,
)
from llmtrain.checkpoint.shards import SHARDS
from llmtrain.config.schema import LOW_BIT_OPTIMIZERS
from llmtrain.core.errors import CheckpointError, ConfigError
from llmtrain.core.files import TRAINER_STATE
from llmtrain.engine.repairs import check_repairs
from llmtrain.engine.state import TrainState

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
    detail = " ".join(line.strip() for line in text.splitlines()
                      if line.strip() and not any(a in line for a in _ADVICE))
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
        raise CheckpointError(f"{path}: format {trainer.get('format')} is not {FORMAT_VERSION}, which this llmtrain "
                              "reads")
    for key in ("state", "sampler", "rng", "config"):
        _expect(isinstance(trainer.get(key), dict), path, name, f"'{key}' is not an object")
    fields = {f.name for f in dataclasses.fields(TrainState)}
    _expect(set(trainer["state"]) <= fields, path, name, f"'state' has keys other than {', '.join(sorted(fields))}")
    _expect(all(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
                for key, value in trainer["state"].items() if key != "repairs"),
            path, name, "'state' holds a value that is not a number")
    wrong_repairs = check_repairs(trainer["state"].get("repairs", {}))
    _expect(wrong_repairs is None, path, name, wrong_repairs or "")
    _check_state_values(path, trainer["state"])
    return trainer


# TrainState's counts (non-negative integers) and the values a run can reach for the others.
_COUNTS = ("step", "tokens", "rollbacks", "skipped_steps", "consecutive_skips", "alarm_skipped_steps",
           "repairs_made")


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
    _allow_low_bit_state(path, trainer["config"])
    opt = _torch_file(path, "optimizer.pt", device)
    keys = ("shards", "scaler") if sharded else ("optimizer", "scaler")
    _expect(isinstance(opt, dict) and all(k in opt for k in keys), path, "optimizer.pt",
            f"a dict of {' and '.join(keys)}")
    _expect(opt["scaler"] is None or isinstance(opt["scaler"], dict), path, "optimizer.pt",
            "the loss scaler is no dict")
    rng = _torch_file(path, "rng.pt", "cpu")
    _expect(isinstance(rng, dict) and isinstance(rng.get("torch"), torch.Tensor), path, "rng.pt",
            "a dict of RNG tensors")
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


def _allow_low_bit_state(path: Path, config: dict) -> None:
    """A checkpoint of optim=adamw8bit/4bit holds torchao's quantized optimizer-state tensors; importing
    torchao.optim adds exactly those types to torch.load's weights_only allowlist (nothing that can
    run code). Without torchao the state cannot be read, which is no damage to the checkpoint."""
    optim = config.get("optim")
    name = optim.get("name") if isinstance(optim, dict) else None
    if name not in {n.value for n in LOW_BIT_OPTIMIZERS}:
        return
    try:
        from llmtrain.engine.optim import import_torchao_optim

        import_torchao_optim()
    except ImportError:
        raise ConfigError(f"{path} holds the optimizer state of optim={name} (torchao's quantized moments), and the "
                          "torchao package is not installed; pip install 'llmtrain[ao]' to resume from it.") from None


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
