"""Where raw text comes from: the embedded default (Python's own stdlib sources) or a user file.

A corpus is a list of documents (relative name + bytes), gathered in a fixed order so the prepared
tokens are identical on every run of the same Python.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Test suites and generated grammars are large, repetitive and in places not UTF-8: leave them out.
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}


@dataclass(frozen=True)
class SourceFile:
    name: str  # stable name, used for the split and the fingerprint
    path: Path


def text_file(path: str) -> Path:
    """The user's text file, or a ConfigError that says what was looked for."""
    from llmtrain.errors import ConfigError

    resolved = Path(path).expanduser()
    if not resolved.is_file():
        raise ConfigError(
            f"'data.path' is '{path}', which is not a readable file (resolved to {resolved.resolve()}); "
            "give the path of a UTF-8 text file, e.g. data.path=/data/corpus.txt."
        )
    if resolved.stat().st_size == 0:
        raise ConfigError(f"'data.path' is '{path}', which is empty; give a UTF-8 text file with the text to train on.")
    return resolved.resolve()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[SourceFile]:
    """The stdlib's .py files, skipped folders pruned, sorted by path components (pathlib's order).

    os.walk on strings, not Path.rglob: this runs before every training and every check, and
    pruning the skipped folders and plain strings make it ~30x faster (0.01 s instead of 0.35 s)."""
    root = stdlib_root()
    names = []
    for folder, subfolders, filenames in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _STDLIB_SKIP]
        rel_folder = os.path.relpath(folder, root)
        prefix = "" if rel_folder == "." else rel_folder.replace(os.sep, "/") + "/"
        names += [prefix + f for f in filenames if f.endswith(".py") and f not in _STDLIB_SKIP]
    names.sort(key=lambda name: name.split("/"))
    files = [SourceFile(name, root / name) for name in names]
    return [f for f in files if f.path.is_file()]


def fingerprint(files: list[SourceFile]) -> str:
    """Cheap staleness check: names, sizes and modification times."""
    h = hashlib.sha256()
    for f in files:
        st = f.path.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def content_hash(documents: list[tuple[str, bytes]]) -> str:
    """The real identity of the corpus: names and contents (as far as max_bytes reads)."""
    h = hashlib.sha256()
    for name, data in documents:
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def read_documents(files: list[SourceFile], max_bytes: int | None) -> list[tuple[str, bytes]]:
    docs, total = [], 0
    for f in files:
        data = f.path.read_bytes()
        if max_bytes is not None and total + len(data) > max_bytes:
            data = data[: max_bytes - total]
        if data:
            docs.append((f.name, data))
            total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    return docs
