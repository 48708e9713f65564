"""Writing a split's token file while the corpus streams by: pieces of documents encoded in
batches (`encode_pieces`; BPE encodes a batch on all cores), end-of-text after each document,
appended to the file with a count per token id (`TokenWriter`), the reading done ahead on a
background thread (`prefetched`)."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from llmtrain.data.corpus import PIECE_BYTES
from llmtrain.data.tokenizers import ByteTokenizer, CharTokenizer, Tokenizer


class TokenWriter:
    """Appends one split's tokens to its file, encoding pieces in batches of about PIECE_BYTES (BPE
    encodes a batch on all cores), with end-of-text after each document; counts tokens per id."""

    def __init__(self, path: Path, tokenizer: Tokenizer, dtype: type) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.tokenizer, self.dtype = tokenizer, dtype
        self.pending: list[tuple[str | bytes, bool]] = []
        self.pending_bytes = 0
        self.tokens = 0
        self.counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)

    def add(self, text: str | bytes, end_of_document: bool) -> None:
        self.pending.append((text, end_of_document))
        self.pending_bytes += len(text)

    def flush_if_full(self) -> int:
        return self.flush() if self.pending_bytes >= PIECE_BYTES else 0

    def flush(self) -> int:
        if not self.pending:
            return 0
        ids = encode_pieces(self.tokenizer, self.pending)
        self.pending, self.pending_bytes = [], 0
        ids.astype(self.dtype, copy=False).tofile(self.file)
        self.counts += np.bincount(ids, minlength=self.tokenizer.vocab_size)
        self.tokens += int(ids.size)
        return int(ids.size)

    def close(self) -> int:
        written = self.flush()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return written


def encode_pieces(tokenizer: Tokenizer, pieces: list[tuple[str | bytes, bool]]) -> np.ndarray:
    """Token ids of the pieces in order, end-of-text after each piece that ends a document, in the
    narrowest type at hand (uint8 for bytes, else uint32). Valid UTF-8 arrives as bytes: the byte
    tokenizer writes it as it is, the others decode it."""
    if isinstance(tokenizer, ByteTokenizer):
        joined = b"".join(
            (p if isinstance(p, bytes) else p.encode("utf-8")) + (b"\xff" if end else b"") for p, end in pieces
        )
        return np.frombuffer(joined, dtype=np.uint8)
    texts = [p.decode("utf-8") if isinstance(p, bytes) else p for p, _ in pieces]
    if isinstance(tokenizer, CharTokenizer):
        encoded = [tokenizer.encode_array(t).astype(np.uint32) for t in texts]
    else:
        encoded = tokenizer.encode_arrays(texts)
    eos = np.asarray([tokenizer.eos_id], dtype=np.uint32)
    parts = [part for ids, (_, end) in zip(encoded, pieces) for part in ((ids, eos) if end else (ids,))]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


def prefetched(items: Iterator, depth: int = 2) -> Iterator:
    """`items`, read ahead on a background thread: file reads (and hashing) overlap with encoding
    and writing, which release the GIL for the heavy parts (Rust BPE, numpy, I/O)."""
    buffer: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        buffer.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            buffer.put(done)
        except BaseException as err:  # handed to the consumer, raised there
            buffer.put(err)

    worker = threading.Thread(target=produce, name="llmtrain-prepare-reader", daemon=True)
    worker.start()
    try:
        while (item := buffer.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        worker.join(timeout=5)
