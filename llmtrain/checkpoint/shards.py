"""Sharded checkpoint files for parallel=fsdp: every rank writes and reads only its own shards,
through torch.distributed.checkpoint (DCP), so no process ever holds the whole model or optimizer.

Inside a checkpoint folder (see layout.py), `shards/` is a DCP checkpoint of one flat dict:

    model/<parameter name>                 the model's tensors
    optimizer/<parameter name>/<entry>     optimizer state tensors (exp_avg, exp_avg_sq, step, ...)

Flat keys of our own keep the layout independent of DCP's nested-dict flattening. Everything that
is not a tensor (parameter groups, their settings, non-tensor state) is kept out of DCP, which
unpickles non-tensor entries without restriction, and goes to optimizer.pt, read with
weights_only=True. DCP reshards on load: a checkpoint written by N ranks loads on M ranks, and in
one process without any process group (resume under single/ddp/zero1, export, sample).

Every read goes through read_metadata: DCP's own FileSystemReader unpickles `.metadata` with plain
pickle.load, so a forged one could run code; ours admits only the metadata's own classes and then
checks the entries against the files (tensors only, pieces inside the folder, sizes within them).
"""

from __future__ import annotations

import hashlib
import math
import pickle
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
_QUANTIZED_RATIO = 8  # float32 bytes over a 4-bit moment's stored bytes (4-bit codes), the smallest state written


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
    """Flat key -> DCP's storage metadata (size and dtype: tensors only) of a shards folder,
    read through the restricted unpickler; raises CheckpointError for a damaged or forged one."""
    return dict(read_metadata(folder).state_dict_metadata)


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
        # into the templates' local shards, in place
        dcp.load(tensors, storage_reader=_safe_reader(folder), planner=_tensors_only_planner())
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
        dcp.load(tensors, storage_reader=_safe_reader(folder), planner=_tensors_only_planner(), no_dist=True)
    model = {key[len(_MODEL):]: value for key, value in tensors.items() if key.startswith(_MODEL)}
    if model_only:
        return model, {}
    by_name = _unflatten_optimizer(tensors, non_tensor["plain_state"])
    groups = non_tensor["param_groups"]
    index = {name: i for i, name in enumerate(name for group in groups for name in group["params"])}
    optimizer = {"state": {index[name]: entries for name, entries in by_name.items()},
                 "param_groups": [{**group, "params": [index[name] for name in group["params"]]} for group in groups]}
    return model, optimizer


# ---------------------------------------------------------------------------------------------
# reading the metadata safely
# ---------------------------------------------------------------------------------------------

METADATA = ".metadata"
# What DCP's .metadata pickles (torch 2.x): its own dataclasses, torch.Size, dtypes, layouts and the
# path it was written to. Nothing else may be looked up, so a forged file cannot call anything.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    (_DCP_METADATA, "Metadata"), (_DCP_METADATA, "MetadataIndex"), (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "TensorStorageMetadata"), (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "ChunkStorageMetadata"), (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only the globals DCP's metadata needs (the stdlib's
    "restricting globals" recipe): every other global, and so every call a payload could make,
    is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (
            module == "torch"
            and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a checkpoint's metadata never holds")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference, which a checkpoint's metadata never holds")


def read_metadata(folder: Path) -> Any:
    """The DCP Metadata of a shards folder, unpickled with only its own classes allowed and then
    checked against the files it points at; raises CheckpointError naming .metadata otherwise."""
    from llmtrain.core.errors import CheckpointError

    path = Path(folder) / METADATA
    try:
        with open(path, "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except Exception as err:  # noqa: BLE001 - whatever is wrong with the bytes, the file is damaged or forged
        raise CheckpointError(f"{path} is not the metadata of a checkpoint llmtrain wrote ({_first_line(err)}); "
                              "nothing in it was run") from None
    problem = _metadata_problem(metadata, Path(folder))
    if problem:
        raise CheckpointError(f"{path} is not the metadata of a checkpoint llmtrain wrote: {problem}")
    return metadata


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0][:300] if text else type(err).__name__) or type(err).__name__


def _metadata_problem(metadata: Any, folder: Path) -> str | None:
    """What makes an unpickled metadata unusable (None: nothing). Besides the types, the sizes
    are checked against the files, so a forged size cannot make a reader allocate more memory
    than the shards on disk hold."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

    if not isinstance(metadata, Metadata):
        return f"it holds a {type(metadata).__name__}, not DCP Metadata"
    entries, storage = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return "its tables of tensors and of storage are missing"
    stored: dict[str, int] = {}  # fqn -> bytes its pieces take on disk
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return "its storage table holds entries of the wrong type"
        name = info.relative_path
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            return f"it points at {name!r}, which is not a file of the shards folder"
        if name not in sizes:
            sizes[name] = (folder / name).stat().st_size if (folder / name).is_file() else -1
        if sizes[name] < 0:
            return f"it points at {name}, which is missing"
        if info.transform_descriptors:  # llmtrain writes no compressed or transformed shards
            return f"it asks for transforms ({info.transform_descriptors!r}) that llmtrain never writes"
        if not (_is_count(info.offset) and _is_count(info.length) and info.offset + info.length <= sizes[name]):
            return f"a piece of {index.fqn!r} lies outside {name} ({sizes[name]} bytes)"
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
    for key, meta in entries.items():
        # Tensors only: DCP would torch.load a non-tensor ("bytes") entry without weights_only, and
        # llmtrain keeps everything that is not a tensor out of the shards (in optimizer.pt).
        if not isinstance(key, str) or not isinstance(meta, TensorStorageMetadata):
            return f"its entry {key!r} is not a tensor (llmtrain's shards hold tensors only)"
        problem = _tensor_problem(meta)
        if problem:
            return f"its tensor {key!r} {problem}"
        wanted = math.prod(meta.size) * meta.properties.dtype.itemsize
        if key.startswith(_OPTIMIZER):
            # torchao's 8-/4-bit moments (optim=adamw8bit/4bit) are stored as their codes and block
            # scales: at least an eighth of the float32 bytes the metadata gives their shape.
            wanted = -(-wanted // _QUANTIZED_RATIO)
        if wanted > stored.get(key, 0):
            return (f"its tensor {key!r} claims {wanted:,} bytes of data, more than the {stored.get(key, 0):,} bytes "
                    "stored for it")
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_problem(meta: Any) -> str | None:
    size, properties = getattr(meta, "size", None), getattr(meta, "properties", None)
    chunks = getattr(meta, "chunks", None)
    if not isinstance(size, torch.Size) or not all(_is_count(n) for n in size):
        return "has no valid shape"
    if not isinstance(getattr(properties, "dtype", None), torch.dtype):
        return "has no valid dtype"
    if not isinstance(chunks, list):
        return "has no list of pieces"
    for chunk in chunks:
        offsets, lengths = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if (not isinstance(offsets, torch.Size) or not isinstance(lengths, torch.Size)
                or len(offsets) != len(size) or len(lengths) != len(size)
                or not all(_is_count(o) and _is_count(n) and o + n <= dim
                           for o, n, dim in zip(offsets, lengths, size))):
            return "has a piece outside its shape"
    return None


def _safe_reader(folder: Path) -> Any:
    """DCP's file-system reader, its metadata read by read_metadata above. Its tensor data is read
    by DCP itself with torch.load(weights_only=True)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(folder)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))


def _tensors_only_planner() -> Any:
    """DCP's default load planner, but one that never unpickles a non-tensor entry (DCP would do
    it with weights_only=False). read_metadata refuses such entries already; this is the backstop."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise ValueError(f"{read_item.dest_index.fqn!r} is not a tensor; llmtrain reads tensors only")

    return TensorsOnly()

def _unflatten_optimizer(tensors: dict[str, torch.Tensor], plain: dict) -> dict[str, dict]:
    state: dict[str, dict] = {name: dict(entries) for name, entries in plain.items()}
    for key, value in tensors.items():
        if key.startswith(_OPTIMIZER):
            name, entry = key[len(_OPTIMIZER):].rsplit("/", 1)
            state.setdefault(name, {})[entry] = value
    return state


@contextmanager
def _as_checkpoint_error(folder: Path) -> Iterator[None]:
    """DCP reports a failed read as CheckpointException, a BaseException; a damaged shard can also
    raise anything torch.load or a copy raises: each made a user-facing error naming the folder."""
    from torch.distributed.checkpoint.api import CheckpointException

    from llmtrain.core.errors import CheckpointError

    try:
        yield
    except CheckpointError:
        raise
    except (CheckpointException, Exception) as err:  # noqa: BLE001 - any failure of the read is a damaged shard
        if isinstance(err, CheckpointException) and err.failures:  # the ranks' own errors, not DCP's traceback text
            err = next(iter(err.failures.values()))[0]
        raise CheckpointError(f"{folder}: its shards could not be read "
                              f"({type(err).__name__}: {_first_line(err)})") from None


def _check_same_keys(folder: Path, wanted: set[str], saved: set[str]) -> None:
    from llmtrain.core.errors import CheckpointError

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
