"""Raw corpus -> memory-mapped train/val token files, prepared once and cached.

The cache folder is keyed by everything that changes the tokens (source, path, tokenizer, split,
byte cap). Inside, `meta.json` records a cheap fingerprint (names, sizes, mtimes) and a content
hash: an unchanged fingerprint reuses the files at once; a changed fingerprint with an unchanged
content hash only refreshes the fingerprint; changed content rebuilds. Builds go to a temporary
folder that is renamed into place, so an interrupted prepare never leaves half-written tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmtrain.config import DataConfig, DataSource, TokenizerKind
from llmtrain.data.corpus import (
    SourceFile,
    content_hash,
    fingerprint,
    read_documents,
    stdlib_files,
    stdlib_root,
    text_file,
)
from llmtrain.data.tokenizers import ByteTokenizer, CharTokenizer, Tokenizer, load_tokenizer, save_tokenizer

FORMAT_VERSION = 1
DOC_SEPARATOR = "\n\n"


@dataclass
class PreparedData:
    directory: Path
    meta: dict

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def unigram_entropy(self) -> float:
        """Entropy of the train split's token frequencies, in nats: the loss of a model that
        ignores context. A model that learned anything beats it."""
        return float(self.meta["unigram_entropy_nats"])

    def tokens(self, split: str) -> np.ndarray:
        if self.meta[f"{split}_tokens"] == 0:  # np.memmap cannot map an empty file
            return np.zeros(0, dtype=np.dtype(self.meta["dtype"]))
        return np.memmap(self.directory / f"{split}.bin", dtype=np.dtype(self.meta["dtype"]), mode="r")

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.directory / "tokenizer.json")


def cache_root(cfg: DataConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    env = os.environ.get("LLMTRAIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llmtrain"


def source_files(cfg: DataConfig) -> list[SourceFile]:
    if cfg.source is DataSource.python_stdlib:
        return stdlib_files()
    assert cfg.path is not None
    path = text_file(cfg.path)
    return [SourceFile(path.name, path)]


def _location(cfg: DataConfig) -> tuple[list[SourceFile], Path]:
    """The source files and the cache folder of the prepared data for `cfg`."""
    files = source_files(cfg)
    identity = {
        "format": FORMAT_VERSION,
        "source": cfg.source.value,
        "files": [str(f.path) for f in files] if cfg.source is DataSource.text else str(stdlib_root()),
        "tokenizer": cfg.tokenizer.value,
        "val_fraction": cfg.val_fraction,
        "max_bytes": cfg.max_bytes,
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return files, cache_root(cfg) / "data" / f"{cfg.source.value}-{cfg.tokenizer.value}-{key}"


def cached_meta(cfg: DataConfig) -> dict | None:
    """The metadata of already prepared, up-to-date data for `cfg`, or None (nothing is built)."""
    files, directory = _location(cfg)
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    return meta if meta.get("fingerprint") == fingerprint(files) else None


def prepare_data(cfg: DataConfig, log: Callable[[str], None] = print) -> PreparedData:
    """Return the prepared data for `cfg`, building it only when missing or stale."""
    files, directory = _location(cfg)
    meta_path = directory / "meta.json"
    quick = fingerprint(files)
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") == quick:
            return PreparedData(directory, meta)
        docs = read_documents(files, cfg.max_bytes)
        if meta.get("content_sha256") == content_hash(docs):
            meta["fingerprint"] = quick
            _atomic_write_text(meta_path, json.dumps(meta, indent=2))
            return PreparedData(directory, meta)
        log(f"data source changed since it was prepared; preparing again into {directory}")
        return _build(cfg, docs, quick, directory)
    log(f"preparing {cfg.source.value} data ({cfg.tokenizer.value} tokens) into {directory}")
    return _build(cfg, read_documents(files, cfg.max_bytes), quick, directory)


def _build(cfg: DataConfig, docs: list[tuple[str, bytes]], quick: str, directory: Path) -> PreparedData:
    total_bytes = sum(len(d) for _, d in docs)
    if cfg.source is DataSource.text:
        train_text, val_text = _split_tail(docs[0][1].decode("utf-8", errors="replace"), cfg.val_fraction)
    else:
        train_parts, val_parts = [], []
        for name, data in docs:
            bucket = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") / 2**64
            (val_parts if bucket < cfg.val_fraction else train_parts).append(data.decode("utf-8", errors="replace"))
        train_text, val_text = DOC_SEPARATOR.join(train_parts), DOC_SEPARATOR.join(val_parts)

    tokenizer: Tokenizer
    if cfg.tokenizer is TokenizerKind.char:
        tokenizer = CharTokenizer.fit(train_text + val_text)
    else:
        tokenizer = ByteTokenizer()
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    train = _encode(tokenizer, train_text, dtype)
    val = _encode(tokenizer, val_text, dtype)
    counts = np.bincount(train, minlength=tokenizer.vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    meta = {
        "format": FORMAT_VERSION,
        "source": cfg.source.value,
        "tokenizer": cfg.tokenizer.value,
        "vocab_size": tokenizer.vocab_size,
        "dtype": np.dtype(dtype).name,
        "documents": len(docs),
        "source_bytes": total_bytes,
        "train_tokens": int(train.size),
        "val_tokens": int(val.size),
        "unigram_entropy_nats": float(-(p * np.log(p)).sum()),
        "fingerprint": quick,
        "content_sha256": content_hash(docs),
    }
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        for split, arr in (("train", train), ("val", val)):
            with open(tmp / f"{split}.bin", "wb") as fh:
                arr.tofile(fh)
                fh.flush()
                os.fsync(fh.fileno())
        save_tokenizer(tokenizer, tmp / "tokenizer.json")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        old = directory.with_name(f"{directory.name}.old-{os.getpid()}")
        if directory.exists():
            os.replace(directory, old)
        try:
            os.replace(tmp, directory)
        except OSError:
            if not (directory / "meta.json").is_file():
                raise
            # Another process finished the same build first: its files are as good as ours.
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PreparedData(directory, meta)


def _split_tail(text: str, val_fraction: float) -> tuple[str, str]:
    """A single file is one stream: the last val_fraction (at a line break) is validation."""
    cut = int(len(text) * (1 - val_fraction))
    newline = text.rfind("\n", 0, cut)
    if newline > len(text) // 2:
        cut = newline + 1
    return text[:cut], text[cut:]


def _encode(tokenizer: Tokenizer, text: str, dtype: type) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype)
    return np.asarray(tokenizer.encode(text), dtype=dtype)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
