"""Writing files and folders whole or not at all: the one place that does it, for checkpoints, the
run's config, reports, evaluation results, prepared data and exports.

A file is written into a temp file beside it, flushed and fsync'ed, then renamed over the real name
and the folder fsync'ed, so a crash or a full disk mid-write leaves the previous file as it was
(a rename needs no space). A folder (a checkpoint, a data cache entry, an export) is built under a
hidden name and swapped into place the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

Contents = bytes | str | Callable[[BinaryIO], Any]  # a str is written as UTF-8


class _HashingWriter:
    """A file wrapper that hashes what passes through, so nothing is read back to hash it."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.sha256 = hashlib.sha256()
        self.size = 0
        # The first failed write. torch's zip writer swallows it and raises its own RuntimeError
        # ("[enforce fail at inline_container.cc] unexpected pos ..."), which names neither the
        # errno nor the file: write_file reports this one instead.
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


def _writer(contents: Contents) -> Callable[[BinaryIO], Any]:
    if callable(contents):
        return contents
    data = contents.encode() if isinstance(contents, str) else contents
    return lambda fh: fh.write(data)


def write_file(path: Path, contents: Contents) -> dict[str, Any]:
    """Write, flush and fsync one file (not atomically: into a folder that is itself swapped into
    place, or as the temp file of `write_atomically`); its sha256 and size. A failed write raises its
    OSError, naming `path`."""
    write, writer = _writer(contents), None
    try:
        with open(path, "wb") as fh:
            writer = _HashingWriter(fh)
            write(writer)  # type: ignore[arg-type]
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


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (the folder's entry, not only the file's bytes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, contents: Contents) -> dict[str, Any]:
    """Write `path` whole or not at all: into a temp file beside it, fsync'ed, then renamed over it.
    On failure the temp file is removed and an existing `path` is left as it was. Its sha256 and size."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        written = write_file(tmp, contents)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return written


def aside(final: Path) -> Path:
    """Where `swap_folder` keeps this process's previous `final` while the new one moves in."""
    return final.with_name(f".old-{final.name}-{os.getpid()}")


def swap_folder(staging: Path, final: Path) -> None:
    """Put the finished folder `staging` in place as `final`. A previous `final` is moved aside
    first and removed only once the new one is in place, or put back if the rename fails or is interrupted (the error
    is raised again)."""
    old = aside(final)
    shutil.rmtree(old, ignore_errors=True)
    moved = False
    try:
        if final.exists():
            os.replace(final, old)
            moved = True
        os.replace(staging, final)
    except BaseException:  # an OSError, or Ctrl-C between the two renames
        if moved and not final.exists():
            with contextlib.suppress(OSError):
                os.replace(old, final)
        raise
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
