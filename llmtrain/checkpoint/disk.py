"""A write that failed, in words: which file system, how much a checkpoint (or the final weights)
needs and how much is free, for a full disk or quota; the errno text for any other OSError.
Also the sizes those messages quote: the bytes of a state dict's tensors, of a checkpoint on disk."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from llmtrain.checkpoint.layout import MANIFEST
from llmtrain.checkpoint.read import list_checkpoints


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
        inner = getattr(tree, "__tensor_flatten__", None)
        if inner is not None and type(tree) is not torch.Tensor:
            # a tensor subclass (torchao's 8-/4-bit optimizer state): the tensors it is stored as
            # (codes, block scales), not its float appearance
            return sum(tensor_bytes(getattr(tree, name)) for name in inner()[0])
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


def previous_checkpoint_bytes(run_dir: Path) -> int | None:
    """The size of the newest checkpoint with a readable manifest (None: there is none)."""
    for path in list_checkpoints(run_dir):
        size = checkpoint_bytes(path)
        if size is not None:
            return size
    return None


def needed_bytes(run_dir: Path, *trees: Any, written: int = 0) -> int | None:
    """About what a checkpoint takes, for a failed save's message: `written` bytes already on disk
    (a sharded save's shards) plus the tensors of `trees` (state dicts); with no trees, or when
    they cannot be measured, the newest checkpoint's size (None: there is none)."""
    if trees:
        try:
            return written + sum(tensor_bytes(tree) for tree in trees)
        except Exception:  # noqa: BLE001 - only an estimate for a message; the previous size will do
            pass
    return previous_checkpoint_bytes(run_dir)
