"""What a prepared folder's meta.json says, and the facts behind its numbers.

`DataMeta` is the one description of meta.json for both kinds of build (text and instruction data);
`unigram_entropy`, `token_facts` and `file_facts` compute the facts the pre-flight check and the
run's summary read from it (the loss to beat, a dominant token, degenerate source files)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from llmtrain.config.schema import DataConfig
from llmtrain.data.cache import FORMAT_VERSION
from llmtrain.data.quality import degenerate_files
from llmtrain.data.tokenizers import Tokenizer


@dataclass(kw_only=True)
class DataMeta:
    """The contents of meta.json as a build writes them, in the file's key order. The fields whose
    default is None are written only when set: the target-token counts and `loss_mask` only for
    instruction data, the file facts and `decoded_from` only for text, the dominant token only when
    the train split has tokens. Old caches are never read through this class: readers
    (`PreparedData.meta`, the pre-flight check, training, evaluation, the report) take meta.json
    as a dict, so a folder written by an older llmtrain reads as it always did."""

    format: int = FORMAT_VERSION
    source: str
    tokenizer: str
    vocab_size: int
    dtype: str
    end_of_text_id: int | None  # always written: None (null) for an old char tokenizer without one
    documents: int
    train_documents: int
    val_documents: int
    undecodable_documents: int
    source_bytes: int
    train_tokens: int
    val_tokens: int
    train_target_tokens: int | None = None  # instruction data: tokens the loss trains on (responses)
    val_target_tokens: int | None = None
    unigram_entropy_nats: float
    dominant_token: str | None = None
    dominant_token_share: float | None = None
    degenerate_files: list | None = None
    degenerate_file_count: int | None = None
    replacement_share: float | None = None
    decoded_from: dict[str, str] | None = None  # text data: {} when no file was UTF-16/32
    fingerprint: str
    content_sha256: str
    loss_mask: bool | None = None  # instruction data: True (a mask file beside each split's tokens)
    # instruction data rendered with a folder's chat template: its file, hash and the first example as shown
    chat_template: dict[str, str] | None = None

    @classmethod
    def of_tokens(cls, cfg: DataConfig, tokenizer: Tokenizer, dtype: type, train_counts: np.ndarray,
                  **facts: Any) -> DataMeta:
        """What every build records about its tokens (format, tokenizer, dtype, the train split's
        entropy and dominant token) plus the build's own `facts`."""
        return cls(source=cfg.source.value, tokenizer=cfg.tokenizer.value, vocab_size=tokenizer.vocab_size,
                   dtype=np.dtype(dtype).name, end_of_text_id=tokenizer.eos_id,
                   unigram_entropy_nats=unigram_entropy(train_counts), **token_facts(train_counts, tokenizer),
                   **facts)

    def to_dict(self) -> dict[str, Any]:
        """The keys meta.json holds, in order: the optional ones only when set."""
        optional = {f.name for f in fields(self) if f.default is None}
        return {key: value for key, value in asdict(self).items() if value is not None or key not in optional}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def unigram_entropy(counts: np.ndarray) -> float:
    """Entropy (nats) of token frequencies: the loss of a model that ignores context."""
    counts = counts.astype(np.float64)
    p = counts[counts > 0] / max(1.0, counts.sum())
    return float(-(p * np.log(p)).sum()) + 0.0  # + 0.0: no "-0.0000" for a one-token corpus


def token_facts(counts: np.ndarray, tokenizer: Tokenizer) -> dict[str, Any]:
    """The train split's most common token and its share (one token dominating is degenerate data);
    nothing for an empty train split."""
    total = int(counts.sum())
    if not total:
        return {}
    top = int(counts.argmax())
    try:
        text = "end-of-text" if top == tokenizer.eos_id else repr(tokenizer.decode([top]))
    except Exception:  # a token that is not text on its own (part of a character)
        text = f"id {top}"
    return {"dominant_token": text, "dominant_token_share": round(int(counts[top]) / total, 4)}


def file_facts(per_file: list[dict]) -> dict[str, Any]:
    """The degenerate source files (binary, UTF-16/32 without a byte-order mark, NUL bytes, whitespace
    only, undecodable...) for the check, from the scan's facts per file: see data/quality.py."""
    listed, count = degenerate_files(per_file)
    replacements = sum(f["replacements"] for f in per_file)
    characters = sum(f["characters"] for f in per_file)
    return {"degenerate_files": listed, "degenerate_file_count": count,
            "replacement_share": round(replacements / max(1, characters), 4)}
