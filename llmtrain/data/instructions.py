"""Instruction data (data=instruct): prompt/response or chat examples, prepared in memory.

`read_instructions` reads the examples (small sets: in memory); `build_instructions` splits them by
the hash of their name, fits the tokenizer and writes each split's tokens, its loss mask (1 = a
response token, trained on) and its example offsets."""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable
from pathlib import Path

import numpy as np

from llmtrain.config.schema import DataConfig
from llmtrain.data.build import write_build
from llmtrain.data.cache import PreparedData
from llmtrain.data.corpus import SourceFile, content_hash, instruction_examples
from llmtrain.data.fit import fit_in_memory
from llmtrain.data.meta import DataMeta
from llmtrain.data.scan import assign_splits, bucket
from llmtrain.data.tokenizers import Tokenizer

Example = list[tuple[str, bool]]  # (text, trained) segments: prompt parts untrained, response parts trained


def read_instructions(cfg: DataConfig, files: list[SourceFile]) -> list[tuple[str, bytes]]:
    """Each example as JSON of its (text, trained) segments. Instruction sets are small: in memory."""
    return [(name, json.dumps(segments).encode()) for f in files
            for name, segments in instruction_examples(f, cfg.prompt_field, cfg.response_field, cfg.messages_field)]


def build_instructions(
    cfg: DataConfig, raw: list[tuple[str, bytes]], quick: str, directory: Path, log: Callable[[str], None]
) -> PreparedData:
    """Examples -> tokens, a loss mask (1 = response token, trained on) and example offsets. The
    end-of-text token closes every example and is a target: the model learns to stop."""
    from llmtrain.core.errors import ConfigError

    if len(raw) < 2:
        raise ConfigError(f"'data.path' ({cfg.path}) has {len(raw)} instruction example(s) with something to train on; "
                          "at least 2 are needed (one goes to validation).")
    examples: list[Example] = [[(text, bool(trained)) for text, trained in json.loads(data)] for _, data in raw]
    everyone = bytearray(b"\x01" * len(raw))
    is_val = assign_splits(array("d", (bucket(name) for name, _ in raw)), everyone, cfg.val_fraction)
    tokenizer = fit_in_memory(cfg, [text for ex in examples for text, _ in ex],
                              ["".join(text for text, _ in ex) for ex, v in zip(examples, is_val) if not v], log)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    arrays, counts = {}, {}
    for split, wanted in (("train", 0), ("val", 1)):
        split_examples = [ex for ex, v in zip(examples, is_val) if v == wanted]
        ids, mask, offsets = _tokenized(split_examples, tokenizer)
        arrays[f"{split}.bin"] = np.asarray(ids, dtype=dtype)
        arrays[f"{split}.mask.bin"] = np.asarray(mask, dtype=np.uint8)
        arrays[f"{split}.idx.npy"] = np.asarray(offsets, dtype=np.int64)
        counts[split] = (len(split_examples), len(ids), int(sum(mask)))
    meta = DataMeta.of_tokens(
        cfg, tokenizer, dtype, np.bincount(arrays["train.bin"], minlength=tokenizer.vocab_size),
        documents=len(examples), train_documents=counts["train"][0], val_documents=counts["val"][0],
        undecodable_documents=0, source_bytes=sum(len(d) for _, d in raw),
        train_tokens=counts["train"][1], val_tokens=counts["val"][1],
        train_target_tokens=counts["train"][2], val_target_tokens=counts["val"][2],
        fingerprint=quick, content_sha256=content_hash(raw), loss_mask=True,
    )
    return write_build(directory, arrays, tokenizer, meta)


def _tokenized(examples: list[Example], tokenizer: Tokenizer) -> tuple[list[int], list[int], list[int]]:
    """One split's token ids, loss mask and example offsets (where each example starts, then the end)."""
    ids: list[int] = []
    mask: list[int] = []
    offsets = [0]
    for segments in examples:
        for text, trained in segments:
            piece = tokenizer.encode(text)
            ids += piece
            mask += [int(trained)] * len(piece)
        if tokenizer.eos_id is not None:
            ids.append(tokenizer.eos_id)
            mask.append(1)
        offsets.append(len(ids))
    return ids, mask, offsets
