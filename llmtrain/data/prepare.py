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

from llmtrain.config import DataConfig, DataSource, DecodeErrors, TokenizerKind
from llmtrain.data.corpus import (
    SourceFile,
    content_hash,
    fingerprint,
    input_files,
    instruction_examples,
    read_documents,
    stdlib_files,
    stdlib_root,
)
from llmtrain.data.tokenizers import (
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    load_tokenizer,
    save_tokenizer,
)

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

    def loss_mask(self, split: str) -> np.ndarray:
        """Instruction data: 1 where a token is a training target (response), 0 for prompt tokens."""
        return np.memmap(self.directory / f"{split}.mask.bin", dtype=np.uint8, mode="r")

    def offsets(self, split: str) -> np.ndarray:
        """Instruction data: where each example starts in the token file (and, last, where the last ends)."""
        return np.load(self.directory / f"{split}.idx.npy")


def cache_root(cfg: DataConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    env = os.environ.get("LLMTRAIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llmtrain"


def source_files(cfg: DataConfig) -> list[SourceFile]:
    if cfg.source is DataSource.python_stdlib:
        return stdlib_files()
    assert cfg.path is not None
    return input_files(cfg.path, cfg.source.value)


def _location(cfg: DataConfig) -> tuple[list[SourceFile], Path]:
    """The source files and the cache folder of the prepared data for `cfg`."""
    files = source_files(cfg)
    identity = {
        "format": FORMAT_VERSION,
        "source": cfg.source.value,
        "files": [str(f.path) for f in files] if cfg.source is not DataSource.python_stdlib else str(stdlib_root()),
        "tokenizer": cfg.tokenizer.value,
        "val_fraction": cfg.val_fraction,
        "max_bytes": cfg.max_bytes,
    }
    # Keys added later only when they differ from their defaults, so caches made before stay valid.
    if cfg.source is DataSource.jsonl:
        identity["text_field"] = cfg.text_field
    if cfg.source is DataSource.instruct:
        identity["fields"] = [cfg.prompt_field, cfg.response_field, cfg.messages_field]
    if cfg.tokenizer is TokenizerKind.bpe:
        identity["bpe_vocab_size"] = cfg.bpe_vocab_size
    if cfg.decode_errors is not DecodeErrors.replace:
        identity["decode_errors"] = cfg.decode_errors.value
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
        docs = _read(cfg, files)
        if meta.get("content_sha256") == content_hash(docs):
            meta["fingerprint"] = quick
            _atomic_write_text(meta_path, json.dumps(meta, indent=2))
            return PreparedData(directory, meta)
        log(f"data source changed since it was prepared; preparing again into {directory}")
        return _build(cfg, docs, quick, directory, log)
    log(f"preparing {cfg.source.value} data ({cfg.tokenizer.value} tokens) into {directory}")
    return _build(cfg, _read(cfg, files), quick, directory, log)


def _read(cfg: DataConfig, files: list[SourceFile]) -> list[tuple[str, bytes]]:
    if cfg.source is DataSource.instruct:  # each example as JSON of its (text, trained) segments
        return [(name, json.dumps(segments).encode()) for f in files
                for name, segments in instruction_examples(f, cfg.prompt_field, cfg.response_field, cfg.messages_field)]
    return read_documents(files, cfg.max_bytes, cfg.text_field if cfg.source is DataSource.jsonl else None)


def _decode(
    docs: list[tuple[str, bytes]], policy: DecodeErrors, log: Callable[[str], None]
) -> tuple[list[tuple[str, str]], int]:
    """UTF-8 text per document, and how many had invalid bytes (repaired with U+FFFD, or skipped)."""
    out, bad = [], []
    for name, data in docs:
        try:
            out.append((name, data.decode("utf-8")))
        except UnicodeDecodeError:
            bad.append(name)
            if policy is DecodeErrors.replace:
                out.append((name, data.decode("utf-8", errors="replace")))
    if bad:
        action = "invalid bytes replaced by U+FFFD" if policy is DecodeErrors.replace else "skipped"
        log(f"{len(bad)} document(s) are not valid UTF-8 ({action}; data.decode_errors=replace|skip), e.g. {bad[0]}")
    return out, len(bad)


def _split(cfg: DataConfig, docs: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Train/validation by document, deterministically (a hash of each name). One document (a single
    file) is one stream: its tail is validation. At least one document goes to validation."""
    if len(docs) == 1:
        train_text, val_text = _split_tail(docs[0][1], cfg.val_fraction)
        return [train_text], [val_text]
    buckets = [int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") / 2**64 for name, _ in docs]
    val_index = {i for i, b in enumerate(buckets) if b < cfg.val_fraction} or {min(range(len(docs)), key=buckets.__getitem__)}
    train = [text for i, (_, text) in enumerate(docs) if i not in val_index]
    val = [text for i, (_, text) in enumerate(docs) if i in val_index]
    return train, val


def _build(
    cfg: DataConfig, raw: list[tuple[str, bytes]], quick: str, directory: Path, log: Callable[[str], None]
) -> PreparedData:
    from llmtrain.errors import ConfigError

    if cfg.source is DataSource.instruct:
        return _build_instructions(cfg, raw, quick, directory, log)
    total_bytes = sum(len(d) for _, d in raw)
    docs, undecodable = _decode(raw, cfg.decode_errors, log)
    if not docs:
        raise ConfigError(f"'data.path' ({cfg.path}) gave no usable text (every document was empty or skipped).")
    train_parts, val_parts = _split(cfg, docs)

    # The separator that joins documents is text too, so the char vocabulary must hold it.
    tokenizer = _fit_tokenizer(cfg, DOC_SEPARATOR.join(train_parts + val_parts), train_parts, log)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    train = _encode_documents(tokenizer, train_parts, dtype)
    val = _encode_documents(tokenizer, val_parts, dtype)
    meta = {
        "format": FORMAT_VERSION,
        "source": cfg.source.value,
        "tokenizer": cfg.tokenizer.value,
        "vocab_size": tokenizer.vocab_size,
        "dtype": np.dtype(dtype).name,
        "documents": len(docs),
        "train_documents": len(train_parts),
        "val_documents": len(val_parts),
        "undecodable_documents": undecodable,
        "source_bytes": total_bytes,
        "train_tokens": int(train.size),
        "val_tokens": int(val.size),
        "unigram_entropy_nats": _unigram_entropy(train, tokenizer.vocab_size),
        "fingerprint": quick,
        "content_sha256": content_hash(raw),
    }
    return _write(directory, {"train.bin": train, "val.bin": val}, tokenizer, meta)


def _write(directory: Path, arrays: dict[str, np.ndarray], tokenizer: Tokenizer, meta: dict) -> PreparedData:
    """Into a temporary folder, fsynced, then renamed into place: never half-written under the real name."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        for name, arr in arrays.items():
            with open(tmp / name, "wb") as fh:
                if name.endswith(".npy"):
                    np.save(fh, arr)
                else:
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


def _build_instructions(
    cfg: DataConfig, raw: list[tuple[str, bytes]], quick: str, directory: Path, log: Callable[[str], None]
) -> PreparedData:
    """Examples -> tokens, a loss mask (1 = response token, trained on) and example offsets."""
    from llmtrain.errors import ConfigError

    if not raw:
        raise ConfigError(f"'data.path' ({cfg.path}) has no instruction example with something to train on.")
    examples = [(name, [(text, bool(trained)) for text, trained in json.loads(data)]) for name, data in raw]
    train_ex, val_ex = _split(cfg, examples)
    tokenizer = _fit_tokenizer(cfg, "".join(text for _, ex in examples for text, _ in ex),
                               ["".join(text for text, _ in ex) for ex in train_ex], log)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    eos = tokenizer.inner.token_to_id(BPETokenizer.END_OF_TEXT) if isinstance(tokenizer, BPETokenizer) else None
    arrays, counts = {}, {}
    for split, split_examples in (("train", train_ex), ("val", val_ex)):
        ids: list[int] = []
        mask: list[int] = []
        offsets = [0]
        for segments in split_examples:
            for text, trained in segments:
                piece = tokenizer.encode(text)
                ids += piece
                mask += [int(trained)] * len(piece)
            if eos is not None:  # the model learns to stop: end-of-text is a target
                ids.append(eos)
                mask.append(1)
            offsets.append(len(ids))
        arrays[f"{split}.bin"] = np.asarray(ids, dtype=dtype)
        arrays[f"{split}.mask.bin"] = np.asarray(mask, dtype=np.uint8)
        arrays[f"{split}.idx.npy"] = np.asarray(offsets, dtype=np.int64)
        counts[split] = (len(split_examples), len(ids), int(sum(mask)))
    meta = {
        "format": FORMAT_VERSION, "source": cfg.source.value, "tokenizer": cfg.tokenizer.value,
        "vocab_size": tokenizer.vocab_size, "dtype": np.dtype(dtype).name, "documents": len(examples),
        "train_documents": counts["train"][0], "val_documents": counts["val"][0], "undecodable_documents": 0,
        "source_bytes": sum(len(d) for _, d in raw), "train_tokens": counts["train"][1], "val_tokens": counts["val"][1],
        "train_target_tokens": counts["train"][2], "val_target_tokens": counts["val"][2],
        "unigram_entropy_nats": _unigram_entropy(arrays["train.bin"], tokenizer.vocab_size), "fingerprint": quick, "content_sha256": content_hash(raw),
        "loss_mask": True,
    }
    return _write(directory, arrays, tokenizer, meta)


def _fit_tokenizer(cfg: DataConfig, all_text: str, train_texts: list[str], log: Callable[[str], None]) -> Tokenizer:
    """char: every character of the corpus; bpe: trained on the train split only; byte: nothing to fit."""
    if cfg.tokenizer is TokenizerKind.char:
        return CharTokenizer.fit(all_text)
    if cfg.tokenizer is TokenizerKind.bpe:
        log(f"training a byte-level BPE tokenizer (vocabulary {cfg.bpe_vocab_size}) on the train split")
        return BPETokenizer.fit(train_texts, cfg.bpe_vocab_size)
    return ByteTokenizer()


def _unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the token frequencies: the loss of a model that ignores context."""
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / max(1.0, counts.sum())
    return float(-(p * np.log(p)).sum())


def _split_tail(text: str, val_fraction: float) -> tuple[str, str]:
    """A single file is one stream: the last val_fraction (at a line break) is validation."""
    cut = int(len(text) * (1 - val_fraction))
    newline = text.rfind("\n", 0, cut)
    if newline > len(text) // 2:
        cut = newline + 1
    return text[:cut], text[cut:]


def _encode_documents(tokenizer: Tokenizer, parts: list[str], dtype: type) -> np.ndarray:
    """Documents in order. byte/char join them with a blank line (the embedded corpus' format);
    BPE puts its end-of-text token between them, so the model sees where a document ends."""
    if isinstance(tokenizer, BPETokenizer):
        eos = tokenizer.inner.token_to_id(BPETokenizer.END_OF_TEXT)
        ids = [i for doc in tokenizer.encode_batch(parts) for i in (*doc, eos)]
        return np.asarray(ids, dtype=dtype)
    return _encode(tokenizer, DOC_SEPARATOR.join(parts), dtype)


def _encode(tokenizer: Tokenizer, text: str, dtype: type) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype)
    return np.asarray(tokenizer.encode(text), dtype=dtype)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
