"""The first pass over a corpus and the train/validation split it decides.

`scan_corpus` reads every document once without tokenizing (`Scan`: sizes, UTF-8 validity, split
buckets, the content hash, per-file facts); `assign_splits` sends documents to validation by the
hash of their name, and a single document is split instead at its tail (`tail_cut_guess`, cut at
a line break by `split_pieces`). `split_pieces` streams the kept documents again, each piece with
its split, for the tokenizer fit and the token files."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field

from llmtrain.config.schema import DataConfig, DataSource
from llmtrain.data.cache import hf_dataset
from llmtrain.data.corpus import SourceFile, capped_documents, complete_utf8_end, document_pieces, hf_documents
from llmtrain.data.progress import ProgressBar
from llmtrain.data.quality import TextStats
from llmtrain.data.token_files import prefetched


@dataclass
class Scan:
    """What the first pass over the corpus learns, without tokenizing: per document its size, whether
    it is valid UTF-8 and its split bucket (a hash of its name); and the corpus' content hash."""

    sizes: array
    valid: bytearray
    buckets: array
    content_sha256: str
    first_invalid: str | None
    file_facts: list[dict] = field(default_factory=list)  # per source file: see data/quality.py


def pieces(cfg: DataConfig, files: list[SourceFile]) -> Iterator[tuple[str, bytes, bool]]:
    """(document name, piece, whether the document ends here) for every document of the corpus."""
    if cfg.source is DataSource.hf:
        return capped_documents(hf_documents(hf_dataset(cfg), cfg.hf_split, cfg.text_field), cfg.max_bytes)
    return document_pieces(files, cfg.max_bytes, cfg.text_field if cfg.source is DataSource.jsonl else None)


def bucket(name: str) -> float:
    """A document's place in [0, 1) by the hash of its name: the same document lands in the same split
    whatever else the corpus holds."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") / 2**64


def _source_of(cfg: DataConfig, document: str) -> str:
    """The file a document comes from (a JSON-lines document is `file:line`; data=hf: the dataset)."""
    if cfg.source is DataSource.hf:
        return str(cfg.hf_name)
    return document.rsplit(":", 1)[0] if cfg.source is DataSource.jsonl else document


def scan_corpus(cfg: DataConfig, files: list[SourceFile], bar: ProgressBar) -> Scan:
    """Read every document once (the progress bar's "scanning" stage) and learn what a build needs."""
    sizes, valid, buckets = array("q"), bytearray(), array("d")
    corpus_hash = hashlib.sha256()
    first_invalid = None
    stats: dict[str, TextStats] = {}
    doc_hash, size, ok = hashlib.sha256(), 0, True
    total = hf_dataset(cfg).data.nbytes if cfg.source is DataSource.hf else sum(f.path.stat().st_size for f in files)
    bar.start("scanning", total)
    for name, piece, last in pieces(cfg, files):
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
            buckets.append(bucket(name))
            doc_hash, size, ok = hashlib.sha256(), 0, True
    return Scan(sizes, valid, buckets, corpus_hash.hexdigest(), first_invalid,
                [s.facts(source) for source, s in stats.items()])


def assign_splits(buckets: array, keep: bytearray, val_fraction: float) -> bytearray:
    """1 for each kept document that goes to validation: those whose name hashes below val_fraction,
    or, if none does, the one that hashes lowest (validation is never empty)."""
    is_val = bytearray(b < val_fraction and k for b, k in zip(buckets, keep))
    if not any(is_val):
        kept = [i for i, k in enumerate(keep) if k]
        is_val[min(kept, key=buckets.__getitem__)] = 1
    return is_val


def tail_cut_guess(size: int, val_fraction: float) -> int:
    """Where a single document's validation tail would start before it is moved to a line break."""
    return int(size * (1 - val_fraction))


def split_pieces(
    cfg: DataConfig, files: list[SourceFile], scan: Scan, keep: bytearray, is_val: bytearray, tail_cut: int | None,
) -> Iterator[tuple[str, str | bytes, bool]]:
    """(split, text, whether a document ends here) for every kept document, in corpus order. Valid
    documents come as their raw bytes (the byte tokenizer needs nothing else); invalid ones as text
    with U+FFFD for the bad bytes. With one document, pieces are cut where validation starts: at the
    last line break before `tail_cut` if that is in the second half, else at `tail_cut` itself."""
    index, offset, line_start = 0, 0, 0
    for _name, piece, last in prefetched(pieces(cfg, files)):
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
            yield from cut(data, piece, at, last)
        newline = piece.rfind(b"\n")
        line_start = offset + newline + 1 if newline >= 0 else line_start
        offset += len(piece)


def cut(data: str | bytes, piece: bytes, at: int, last: bool) -> Iterator[tuple[str, str | bytes, bool]]:
    """A piece split at byte `at` into its train head and its validation tail."""
    head, tail = piece[:at], piece[at:]
    if isinstance(data, str):
        head, tail = head.decode("utf-8", errors="replace"), tail.decode("utf-8", errors="replace")
    yield "train", head, False
    yield "val", tail, last
