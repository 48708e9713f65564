"""Sharded checkpoint files for parallel=fsdp: every rank writes and reads only its own shards,
through torch.distributed.checkpoint (DCP), so no process ever holds the whole model or optimizer.

Inside a checkpoint folder (see checkpoint.py), `shards/` is a DCP checkpoint of one flat dict:

    model/<parameter name>                 the model's tensors
    optimizer/<parameter name>/<entry>     optimizer state tensors (exp_avg, exp_avg_sq, step, ...)

Flat keys of our own keep the layout independent of DCP's nested-dict flattening. Everything that
is not a tensor (parameter groups, their settings, non-tensor state) is kept out of DCP, which
unpickles non-tensor entries without restriction, and goes to optimizer.pt, read with
weights_only=True. DCP reshards on load: a checkpoint written by N ranks loads on M ranks, and in
one process without any process group (resume under single/ddp/zero1, export, sample).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SHARDS = "shards"
ERROR_KEY = "<error>"  # in a gathered dict of file hashes: a rank could not hash its share
_MODEL, _OPTIMIZER = "model/", "optimizer/"


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state of an FSDP2 model as each rank holds it: DTensors, keyed by name.
    Reading the optimizer's state creates it (zeros) when no step was taken yet."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)


def _flatten(model_state: dict, optimizer_state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors under flat keys, the non-tensor optimizer state by parameter name and entry)."""
    tensors = {_MODEL + name: value for name, value in model_state.items()}
    plain: dict[str, dict[str, Any]] = {}
    for name, entries in optimizer_state["state"].items():
        for entry, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_OPTIMIZER}{name}/{entry}"] = value
            else:
                plain.setdefault(name, {})[entry] = value
    return tensors, plain


def write_shards(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Write this rank's shards into `folder` (a collective: every rank calls it with the same
    folder, on a file system they all see). Returns the non-tensor optimizer part for optimizer.pt:
    {"param_groups": [... params by name ...], "plain_state": {name: {entry: value}}}."""
    import torch.distributed.checkpoint as dcp

    model_state, optimizer_state = _sharded_state(model, optimizer)
    tensors, plain = _flatten(model_state, optimizer_state)
    dcp.save(tensors, checkpoint_id=str(folder))
    return {"param_groups": optimizer_state["param_groups"], "plain_state": plain}


def hash_files(folder: Path, rank: int, world_size: int) -> dict[str, dict]:
    """sha256 and size of this rank's share of the files under `folder` (every world_size-th, by
    name), so the ranks hash a large checkpoint together rather than rank 0 alone."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    entries = {}
    for path in files[rank::world_size]:
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                digest.update(chunk)
        entries[str(path.relative_to(folder.parent))] = {"sha256": digest.hexdigest(), "bytes": path.stat().st_size}
    return entries


def saved_keys(folder: Path) -> dict[str, Any]:
    """Flat key -> DCP's storage metadata (size and dtype for tensors) of a shards folder."""
    from torch.distributed.checkpoint import FileSystemReader

    return dict(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def read_shards_into(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, non_tensor: dict) -> None:
    """Load a shards folder into an FSDP2 model and its optimizer, each rank reading just the
    pieces of its own shards (a collective). The writing run's world size does not matter."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model_state, optimizer_state = _sharded_state(model, optimizer)
    tensors, _ = _flatten(model_state, optimizer_state)
    saved = saved_keys(folder)
    if not any(key.startswith(_OPTIMIZER) for key in saved):  # saved before the first step: no moments yet
        tensors = {key: value for key, value in tensors.items() if key.startswith(_MODEL)}
    _check_same_keys(folder, set(tensors), set(saved))
    with _as_checkpoint_error(folder):
        dcp.load(tensors, checkpoint_id=str(folder))  # into the templates' local shards, in place
    set_model_state_dict(model, {name[len(_MODEL):]: tensors[name] for name in tensors if name.startswith(_MODEL)})
    if any(key.startswith(_OPTIMIZER) for key in tensors):
        state = _unflatten_optimizer(tensors, non_tensor["plain_state"])
        set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": non_tensor["param_groups"]})


def read_full(folder: Path, non_tensor: dict, device: torch.device | str = "cpu",
              model_only: bool = False) -> tuple[dict, dict]:
    """(model state_dict, optimizer state_dict) whole, in the plain formats of one process (the
    optimizer's keyed by parameter index in group order), read without any process group.
    `model_only`: the weights alone (a third of the bytes under Adam); the optimizer comes back {}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype, device=device)
               for key, meta in saved_keys(folder).items()
               if isinstance(meta, TensorStorageMetadata) and (key.startswith(_MODEL) or not model_only)}
    with _as_checkpoint_error(folder), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(tensors, checkpoint_id=str(folder), no_dist=True)
    model = {key[len(_MODEL):]: value for key, value in tensors.items() if key.startswith(_MODEL)}
    if model_only:
        return model, {}
    by_name = _unflatten_optimizer(tensors, non_tensor["plain_state"])
    groups = non_tensor["param_groups"]
    index = {name: i for i, name in enumerate(name for group in groups for name in group["params"])}
    optimizer = {"state": {index[name]: entries for name, entries in by_name.items()},
                 "param_groups": [{**group, "params": [index[name] for name in group["params"]]} for group in groups]}
    return model, optimizer


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], plain: dict) -> dict[str, dict]:
    state: dict[str, dict] = {name: dict(entries) for name, entries in plain.items()}
    for key, value in tensors.items():
        if key.startswith(_OPTIMIZER):
            name, entry = key[len(_OPTIMIZER):].rsplit("/", 1)
            state.setdefault(name, {})[entry] = value
    return state


@contextmanager
def _as_checkpoint_error(folder: Path) -> Iterator[None]:
    """DCP reports a failed read as CheckpointException, a BaseException: made a user-facing error."""
    from torch.distributed.checkpoint.api import CheckpointException

    from llmtrain.checkpoint import CheckpointError

    try:
        yield
    except CheckpointException as err:
        raise CheckpointError(f"{folder}: its shards could not be read ({str(err).strip()[:500]})") from None


def _check_same_keys(folder: Path, wanted: set[str], saved: set[str]) -> None:
    from llmtrain.checkpoint import CheckpointError

    missing, extra = sorted(wanted - saved), sorted(saved - wanted)
    if missing or extra:
        raise CheckpointError(
            f"{folder}: its tensors do not fit this model/optimizer (missing: {', '.join(missing[:5]) or 'none'}; "
            f"not in this model: {', '.join(extra[:5]) or 'none'})"
        )


def all_gather_dicts(value: dict, world_size: int) -> dict:
    """The union of every rank's dict, on every rank."""
    if world_size == 1 or not dist.is_initialized():
        return dict(value)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return {key: entry for part in gathered for key, entry in part.items()}
