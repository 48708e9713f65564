"""Raw corpus -> memory-mapped train/val token files, prepared once and cached.

cache.py says where a config's prepared data lives and whether it is up to date; this module
builds it. An unchanged fingerprint reuses the files at once; a changed fingerprint with an
unchanged content hash only refreshes the fingerprint; changed content rebuilds: scan the corpus,
split it by document, fit the tokenizer, and write each split's tokens (token_files.py) while the
progress bar (progress.py) shows how far it is. Builds go to a temporary folder that is renamed
into place, so an interrupted prepare never leaves half-written tokens."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmtrain.config.schema import DataConfig, DataSource, DecodeErrors, TokenizerKind
from llmtrain.core.atomic import swap_folder, write_atomically, write_file
from llmtrain.core.files import TOKENIZER  # the same file name in the data cache as in a run dir
from llmtrain.data.cache import (
    FORMAT_VERSION,
    PreparedData,
    current_fingerprint,
    decoded_files,
    gpt2_files_of,
    hf_dataset,
    location,
    pretrained_tokenizer,
)
from llmtrain.data.corpus import (
    SourceFile,
    capped_documents,
    complete_utf8_end,
    content_hash,
    document_pieces,
    hf_documents,
    instruction_examples,
)
from llmtrain.data.progress import ProgressBar
from llmtrain.data.quality import TextStats, degenerate_files
from llmtrain.data.token_files import TokenWriter, prefetched
from llmtrain.data.tokenizers import (
    GPT2_SHA256,
    GPT2_URL,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    PretrainedTokenizer,
    Tokenizer,
    gpt2_tokenizer,
    save_tokenizer,
)


def _gpt2_tokenizer(cfg: DataConfig, log: Callable[[str], None]) -> Tokenizer:
    from llmtrain.core.errors import ConfigError

    paths = gpt2_files_of(cfg)
    if [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths] != list(GPT2_SHA256):
        log(f"{paths[0]} / {paths[1]} are not the published GPT-2 files (their SHA-256 differs); used as given")
    try:
        return gpt2_tokenizer(paths)
    except ImportError:
        raise ConfigError("data.tokenizer=gpt2 needs the tiktoken package: pip install tiktoken") from None
    except FileNotFoundError as err:
        raise ConfigError(f"data.tokenizer=gpt2: {err}; give the files from {GPT2_URL}") from None


def prepare_data(cfg: DataConfig, log: Callable[[str], None] = print, progress: bool = False) -> PreparedData:
    """Return the prepared data for `cfg`, building it only when missing or stale. `progress` shows
    a live bar (bytes, documents, tokens/s, ETA) on stderr while a build runs."""
    files, directory = location(cfg)
    meta_path = directory / "meta.json"
    quick = current_fingerprint(cfg, files)
    with ProgressBar(progress) as bar:
        log = bar.routed(log)
        if meta_path.is_file():
            meta = json.loads(meta_path.read_text())
            if meta.get("fingerprint") == quick:
                return PreparedData(directory, meta)
            if cfg.source is DataSource.instruct:
                raw = _read_instructions(cfg, files)
                digest, scan = content_hash(raw), None
            else:
                scan = _scan(cfg, files, bar)
                digest = scan.content_sha256
            if meta.get("content_sha256") == digest:
                meta["fingerprint"] = quick
                write_atomically(meta_path, json.dumps(meta, indent=2))
                return PreparedData(directory, meta)
            log(f"data source changed since it was prepared; preparing again into {directory}")
        else:
            log(f"preparing {cfg.source.value} data ({cfg.tokenizer.value} tokens) into {directory}")
            scan = raw = None
        if cfg.source is DataSource.instruct:
            return _build_instructions(cfg, raw or _read_instructions(cfg, files), quick, directory, log)
        return _build(cfg, files, scan or _scan(cfg, files, bar), quick, directory, log, bar)


def _read_instructions(cfg: DataConfig, files: list[SourceFile]) -> list[tuple[str, bytes]]:
    """Each example as JSON of its (text, trained) segments. Instruction sets are small: in memory."""
    return [(name, json.dumps(segments).encode()) for f in files
            for name, segments in instruction_examples(f, cfg.prompt_field, cfg.response_field, cfg.messages_field)]


def _pieces(cfg: DataConfig, files: list[SourceFile]) -> Iterator[tuple[str, bytes, bool]]:
    if cfg.source is DataSource.hf:
        return capped_documents(hf_documents(hf_dataset(cfg), cfg.hf_split, cfg.text_field), cfg.max_bytes)
    return document_pieces(files, cfg.max_bytes, cfg.text_field if cfg.source is DataSource.jsonl else None)


@dataclass
class _Scan:
    """What the first pass over the corpus learns, without tokenizing: per document its size, whether
    it is valid UTF-8 and its split bucket (a hash of its name); and the corpus' content hash."""

    sizes: array
    valid: bytearray
    buckets: array
    content_sha256: str
    first_invalid: str | None
    file_facts: list[dict] = field(default_factory=list)  # per source file: see data/quality.py


def _source_of(cfg: DataConfig, document: str) -> str:
    """The file a document comes from (a JSON-lines document is `file:line`; data=hf: the dataset)."""
    if cfg.source is DataSource.hf:
        return str(cfg.hf_name)
    return document.rsplit(":", 1)[0] if cfg.source is DataSource.jsonl else document


def _scan(cfg: DataConfig, files: list[SourceFile], bar: ProgressBar) -> _Scan:
    sizes, valid, buckets = array("q"), bytearray(), array("d")
    corpus_hash = hashlib.sha256()
    first_invalid = None
    stats: dict[str, TextStats] = {}
    doc_hash, size, ok = hashlib.sha256(), 0, True
    total = hf_dataset(cfg).data.nbytes if cfg.source is DataSource.hf else sum(f.path.stat().st_size for f in files)
    bar.start("scanning", total)
    for name, piece, last in _pieces(cfg, files):
        doc_hash.update(piece)
        size += len(piece)
        if ok:
            try:
                piece.decode("utf-8")
            except UnicodeDecodeError:
                ok = False
                first_invalid = first_invalid or name
        source = _source_of(cfg, name)
        (stats.get(source) or stats.setdefault(source, TextStats())).add(piece, ok)
        bar.advance(len(piece), documents=int(last))
        if last:
            corpus_hash.update(name.encode() + b"\0" + doc_hash.digest())
            sizes.append(size)
            valid.append(ok)
            buckets.append(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") / 2**64)
            doc_hash, size, ok = hashlib.sha256(), 0, True
    return _Scan(sizes, valid, buckets, corpus_hash.hexdigest(), first_invalid,
                 [s.facts(source) for source, s in stats.items()])


def _assign_splits(scan: _Scan, keep: bytearray, val_fraction: float) -> bytearray:
    """1 for each kept document that goes to validation: those whose name hashes below val_fraction,
    or, if none does, the one that hashes lowest (validation is never empty)."""
    is_val = bytearray(b < val_fraction and k for b, k in zip(scan.buckets, keep))
    if not any(is_val):
        kept = [i for i, k in enumerate(keep) if k]
        is_val[min(kept, key=scan.buckets.__getitem__)] = 1
    return is_val


def _build(
    cfg: DataConfig, files: list[SourceFile], scan: _Scan, quick: str, directory: Path, log: Callable[[str], None],
    bar: ProgressBar,
) -> PreparedData:
    """Plain text, streamed: documents are read in pieces, split by document, tokenized in batches and
    appended to the split's token file with end-of-text after every document."""
    from llmtrain.core.errors import ConfigError

    skip = cfg.decode_errors is DecodeErrors.skip
    keep = bytearray(v or not skip for v in scan.valid)
    kept = [i for i, k in enumerate(keep) if k]
    undecodable = len(scan.valid) - sum(scan.valid)
    if undecodable:
        action = "skipped" if skip else "invalid bytes replaced by U+FFFD"
        log(f"{undecodable} document(s) are not valid UTF-8 ({action}; data.decode_errors=replace|skip), "
            f"e.g. {scan.first_invalid}")
    decoded = decoded_files(cfg, files)
    _log_decoded(decoded, log)
    if not scan.valid:
        raise ConfigError(f"The data ({_describe(cfg)}) holds no text: every document is empty (an empty file, an "
                          f"empty '{cfg.text_field}' field or row); give documents with text.")
    if not kept:
        raise ConfigError(f"The data ({_describe(cfg)}) gave no usable text: every document was skipped as not "
                          "UTF-8 (data.decode_errors=skip); give UTF-8 text or use data.decode_errors=replace.")
    # One document (a single file) is one stream: its tail, cut at a line break, is validation.
    tail_cut = _tail_cut_guess(scan.sizes[kept[0]], cfg.val_fraction) if len(kept) == 1 else None
    is_val = bytearray(len(keep)) if tail_cut is not None else _assign_splits(scan, keep, cfg.val_fraction)

    tokenizer = _fit_tokenizer(cfg, files, scan, keep, is_val, tail_cut, log, bar)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    tmp = _fresh_tmp(directory)
    writers: dict[str, TokenWriter] = {}
    try:
        writers = {split: TokenWriter(tmp / f"{split}.bin", tokenizer, dtype) for split in ("train", "val")}
        bar.start("tokenizing", sum(scan.sizes[i] for i in kept))
        for split, text, end_of_document in _split_pieces(cfg, files, scan, keep, is_val, tail_cut):
            writers[split].add(text, end_of_document)
            bar.advance(len(text), documents=int(end_of_document), tokens=writers[split].flush_if_full())
        for writer in writers.values():
            bar.advance(0, tokens=writer.close())
        train, val = writers["train"], writers["val"]
        meta = {
            "format": FORMAT_VERSION,
            "source": cfg.source.value,
            "tokenizer": cfg.tokenizer.value,
            "vocab_size": tokenizer.vocab_size,
            "dtype": np.dtype(dtype).name,
            "end_of_text_id": tokenizer.eos_id,
            "documents": len(kept),
            "train_documents": len(kept) - sum(is_val) if tail_cut is None else 1,
            "val_documents": sum(is_val) if tail_cut is None else 1,
            "undecodable_documents": undecodable,
            "source_bytes": sum(scan.sizes),
            "train_tokens": train.tokens,
            "val_tokens": val.tokens,
            "unigram_entropy_nats": _entropy(train.counts),
            **_token_facts(train.counts, tokenizer),
            **_file_facts(scan),
            "decoded_from": decoded,
            "fingerprint": quick,
            "content_sha256": scan.content_sha256,
        }
        save_tokenizer(tokenizer, tmp / TOKENIZER)
        write_file(tmp / "meta.json", json.dumps(meta, indent=2))
        _commit(tmp, directory)
    finally:
        for writer in writers.values():
            writer.file.close()  # already closed after a whole build; an interrupted one leaves them open
        shutil.rmtree(tmp, ignore_errors=True)
    return PreparedData(directory, meta, built=True)


def _log_decoded(decoded: dict[str, str], log: Callable[[str], None]) -> None:
    """Say once which files were decoded from UTF-16/32 (a long list: the first few)."""
    if 0 < len(decoded) <= 3:
        for name, encoding in decoded.items():
            log(f"{name}: {encoding} (byte-order mark), decoded as such")
    elif decoded:
        examples = ", ".join(f"{name} ({encoding})" for name, encoding in list(decoded.items())[:3])
        log(f"{len(decoded)} files start with a UTF-16/32 byte-order mark and were decoded as such, e.g. {examples}")


def _token_facts(counts: np.ndarray, tokenizer: Tokenizer) -> dict:
    """The train split's most common token and its share (one token dominating is degenerate data)."""
    total = int(counts.sum())
    if not total:
        return {}
    top = int(counts.argmax())
    try:
        text = "end-of-text" if top == tokenizer.eos_id else repr(tokenizer.decode([top]))
    except Exception:  # a token that is not text on its own (part of a character)
        text = f"id {top}"
    return {"dominant_token": text, "dominant_token_share": round(int(counts[top]) / total, 4)}


def _file_facts(scan: _Scan) -> dict:
    """The degenerate source files (binary, UTF-16/32 without a byte-order mark, NUL bytes, whitespace
    only, undecodable...) for the check: see data/quality.py."""
    listed, count = degenerate_files(scan.file_facts)
    replacements = sum(f["replacements"] for f in scan.file_facts)
    characters = sum(f["characters"] for f in scan.file_facts)
    return {"degenerate_files": listed, "degenerate_file_count": count,
            "replacement_share": round(replacements / max(1, characters), 4)}


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KB"


def _describe(cfg: DataConfig) -> str:
    return {DataSource.hf: f"data.hf_name={cfg.hf_name}", DataSource.python_stdlib: "the stdlib"}.get(
        cfg.source, f"data.path={cfg.path}")


def _tail_cut_guess(size: int, val_fraction: float) -> int:
    return int(size * (1 - val_fraction))


def _split_pieces(
    cfg: DataConfig, files: list[SourceFile], scan: _Scan, keep: bytearray, is_val: bytearray, tail_cut: int | None,
) -> Iterator[tuple[str, str | bytes, bool]]:
    """(split, text, whether a document ends here) for every kept document, in corpus order. Valid
    documents come as their raw bytes (the byte tokenizer needs nothing else); invalid ones as text
    with U+FFFD for the bad bytes. With one document, pieces are cut where validation starts: at the
    last line break before `tail_cut` if that is in the second half, else at `tail_cut` itself."""
    index, offset, line_start = 0, 0, 0
    for _name, piece, last in prefetched(_pieces(cfg, files)):
        document, index = index, index + int(last)
        if not keep[document]:
            continue
        data: str | bytes = piece if scan.valid[document] else piece.decode("utf-8", errors="replace")
        if tail_cut is None:
            yield ("val" if is_val[document] else "train"), data, last
            continue
        # The one kept document (offset and line_start count its bytes only).
        if offset + len(piece) <= tail_cut:
            yield "train", data, False
        elif offset > tail_cut:
            yield "val", data, last
        else:  # the piece where validation starts (pieces end at line breaks but for very long lines)
            newline = piece.rfind(b"\n", 0, tail_cut - offset)
            start = offset + newline + 1 if newline >= 0 else line_start
            at = (start - offset if start >= offset and start > scan.sizes[document] // 2
                  else complete_utf8_end(piece[: tail_cut - offset]))
            yield from _cut(data, piece, at, last)
        newline = piece.rfind(b"\n")
        line_start = offset + newline + 1 if newline >= 0 else line_start
        offset += len(piece)


def _cut(data: str | bytes, piece: bytes, at: int, last: bool) -> Iterator[tuple[str, str | bytes, bool]]:
    """A piece split at byte `at` into its train head and its validation tail."""
    head, tail = piece[:at], piece[at:]
    if isinstance(data, str):
        head, tail = head.decode("utf-8", errors="replace"), tail.decode("utf-8", errors="replace")
    yield "train", head, False
    yield "val", tail, last


def _fit_tokenizer(
    cfg: DataConfig, files: list[SourceFile], scan: _Scan, keep: bytearray, is_val: bytearray, tail_cut: int | None,
    log: Callable[[str], None], bar: ProgressBar,
) -> Tokenizer:
    """char: every character of the corpus (both splits: validation must encode too); bpe: trained on
    the train split, on at most data.bpe_sample_bytes of it spread over its documents; byte, gpt2
    and pretrained (a model folder's tokenizer.json): nothing to fit."""
    if cfg.tokenizer is TokenizerKind.byte:
        return ByteTokenizer()
    if cfg.tokenizer is TokenizerKind.gpt2:
        return _gpt2_tokenizer(cfg, log)
    if cfg.tokenizer is TokenizerKind.pretrained:
        return _logged_pretrained(cfg, log)
    if cfg.tokenizer is TokenizerKind.char:
        characters: set[str] = set()
        bar.start("collecting characters", sum(scan.sizes[i] for i, k in enumerate(keep) if k))
        for _, text, _ in _split_pieces(cfg, files, scan, keep, is_val, tail_cut):
            characters.update(text.decode("utf-8") if isinstance(text, bytes) else text)
            bar.advance(len(text))
        return CharTokenizer.fit(characters)
    train_bytes = sum(size for size, k, v in zip(scan.sizes, keep, is_val) if k and not v)
    train_bytes = train_bytes if tail_cut is None else tail_cut
    stride = max(1, math.ceil(train_bytes / cfg.bpe_sample_bytes))  # every stride-th train document
    planned = min(train_bytes, cfg.bpe_sample_bytes)
    sample_of = (f"the whole train split ({_size(train_bytes)})" if planned == train_bytes else
                 f"about {_size(planned)} of the train split's {_size(train_bytes)} "
                 f"(data.bpe_sample_bytes={cfg.bpe_sample_bytes})")
    log(f"training a byte-level BPE tokenizer (vocabulary {cfg.bpe_vocab_size}) on {sample_of}")
    bar.start("training BPE (reading the sample)", planned)

    def sample() -> Iterator[str]:
        budget, document = cfg.bpe_sample_bytes, 0
        for split, text, end in _split_pieces(cfg, files, scan, keep, is_val, tail_cut):
            if split == "train" and document % stride == 0:
                budget -= len(text)
                bar.advance(len(text), documents=int(end))
                yield text.decode("utf-8") if isinstance(text, bytes) else text
                if budget <= 0:
                    return
            document += int(end and split == "train")

    return BPETokenizer.fit(sample(), cfg.bpe_vocab_size)


def _fresh_tmp(directory: Path) -> Path:
    """An empty build folder next to `directory`; the build lands under the real name only whole."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _commit(tmp: Path, directory: Path) -> None:
    """Rename a finished build folder into place (the previous version is removed only after)."""
    try:
        swap_folder(tmp, directory)
    except OSError:
        if not (directory / "meta.json").is_file():
            raise
        # Another process finished the same build first: its files are as good as ours.


def _write(directory: Path, arrays: dict[str, np.ndarray], tokenizer: Tokenizer, meta: dict) -> PreparedData:
    """Into a temporary folder, fsynced, then renamed into place: never half-written under the real name."""
    tmp = _fresh_tmp(directory)
    try:
        for name, arr in arrays.items():
            with open(tmp / name, "wb") as fh:  # not write_file: its sha256 would cost a pass over every token
                if name.endswith(".npy"):
                    np.save(fh, arr)
                else:
                    arr.tofile(fh)
                fh.flush()
                os.fsync(fh.fileno())
        save_tokenizer(tokenizer, tmp / TOKENIZER)
        write_file(tmp / "meta.json", json.dumps(meta, indent=2))
        _commit(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PreparedData(directory, meta, built=True)


def _build_instructions(
    cfg: DataConfig, raw: list[tuple[str, bytes]], quick: str, directory: Path, log: Callable[[str], None]
) -> PreparedData:
    """Examples -> tokens, a loss mask (1 = response token, trained on) and example offsets. The
    end-of-text token closes every example and is a target: the model learns to stop."""
    from llmtrain.core.errors import ConfigError

    if len(raw) < 2:
        raise ConfigError(f"'data.path' ({cfg.path}) has {len(raw)} instruction example(s) with something to train on; "
                          "at least 2 are needed (one goes to validation).")
    examples = [[(text, bool(trained)) for text, trained in json.loads(data)] for _, data in raw]
    buckets = array(
        "d", (int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") / 2**64 for name, _ in raw)
    )
    everyone = bytearray(b"\x01" * len(raw))
    is_val = _assign_splits(_Scan(array("q"), everyone, buckets, "", None), everyone, cfg.val_fraction)
    tokenizer = _fit_in_memory(cfg, [text for ex in examples for text, _ in ex],
                               ["".join(text for text, _ in ex) for ex, v in zip(examples, is_val) if not v], log)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    arrays, counts = {}, {}
    for split, wanted in (("train", 0), ("val", 1)):
        ids: list[int] = []
        mask: list[int] = []
        offsets = [0]
        split_examples = [ex for ex, v in zip(examples, is_val) if v == wanted]
        for segments in split_examples:
            for text, trained in segments:
                piece = tokenizer.encode(text)
                ids += piece
                mask += [int(trained)] * len(piece)
            if tokenizer.eos_id is not None:
                ids.append(tokenizer.eos_id)
                mask.append(1)
            offsets.append(len(ids))
        arrays[f"{split}.bin"] = np.asarray(ids, dtype=dtype)
        arrays[f"{split}.mask.bin"] = np.asarray(mask, dtype=np.uint8)
        arrays[f"{split}.idx.npy"] = np.asarray(offsets, dtype=np.int64)
        counts[split] = (len(split_examples), len(ids), int(sum(mask)))
    meta = {
        "format": FORMAT_VERSION, "source": cfg.source.value, "tokenizer": cfg.tokenizer.value,
        "vocab_size": tokenizer.vocab_size, "dtype": np.dtype(dtype).name, "end_of_text_id": tokenizer.eos_id,
        "documents": len(examples), "train_documents": counts["train"][0], "val_documents": counts["val"][0],
        "undecodable_documents": 0, "source_bytes": sum(len(d) for _, d in raw),
        "train_tokens": counts["train"][1], "val_tokens": counts["val"][1],
        "train_target_tokens": counts["train"][2], "val_target_tokens": counts["val"][2],
        "unigram_entropy_nats": _entropy(np.bincount(arrays["train.bin"], minlength=tokenizer.vocab_size)),
        **_token_facts(np.bincount(arrays["train.bin"], minlength=tokenizer.vocab_size), tokenizer),
        "fingerprint": quick, "content_sha256": content_hash(raw), "loss_mask": True,
    }
    return _write(directory, arrays, tokenizer, meta)


def _fit_in_memory(
    cfg: DataConfig, all_texts: list[str], train_texts: list[str], log: Callable[[str], None]
) -> Tokenizer:
    if cfg.tokenizer is TokenizerKind.char:
        return CharTokenizer.fit(set().union(*map(set, all_texts)))
    if cfg.tokenizer is TokenizerKind.bpe:
        log(f"training a byte-level BPE tokenizer (vocabulary {cfg.bpe_vocab_size}) on the train split")
        return BPETokenizer.fit(iter(train_texts), cfg.bpe_vocab_size)
    if cfg.tokenizer is TokenizerKind.gpt2:
        return _gpt2_tokenizer(cfg, log)
    if cfg.tokenizer is TokenizerKind.pretrained:
        return _logged_pretrained(cfg, log)
    return ByteTokenizer()


def _logged_pretrained(cfg: DataConfig, log: Callable[[str], None]) -> PretrainedTokenizer:
    tokenizer = pretrained_tokenizer(cfg)
    end = tokenizer.inner.id_to_token(tokenizer.eos_id)
    log(f"tokenizer.json of {cfg.tokenizer_dir}: vocabulary {tokenizer.vocab_size:,}, end-of-text {end} "
        f"(id {tokenizer.eos_id}, from {tokenizer.eos_origin or 'the saved tokenizer'})")
    return tokenizer


def _entropy(counts: np.ndarray) -> float:
    """Entropy (nats) of token frequencies: the loss of a model that ignores context."""
    counts = counts.astype(np.float64)
    p = counts[counts > 0] / max(1.0, counts.sum())
    return float(-(p * np.log(p)).sum()) + 0.0  # + 0.0: no "-0.0000" for a one-token corpus


