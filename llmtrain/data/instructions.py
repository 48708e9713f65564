"""Instruction data (data=instruct): prompt/response or chat examples, prepared in memory.

`read_instructions` reads the examples (small sets: in memory); `build_instructions` splits them by
the hash of their name, fits the tokenizer and writes each split's tokens, its loss mask (1 = a
response token, trained on) and its example offsets.

With a folder's tokenizer whose folder has a chat template (chat_template.py), every example is
that template's rendering: the whole text tokenized at once, as transformers tokenizes it, and a
token trained when its characters overlap a trained span; nothing is appended (the template's own
end-of-turn token, trained on, ends each assistant turn). Otherwise llmtrain's own format: each
piece tokenized on its own, the end-of-text token after every example."""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable
from pathlib import Path

import numpy as np

from llmtrain.config.schema import DataConfig
from llmtrain.data.build import write_build
from llmtrain.data.cache import PreparedData, chat_template
from llmtrain.data.chat_template import ChatTemplate, TemplateProblem, preview
from llmtrain.data.corpus import SourceFile, content_hash, instruction_examples
from llmtrain.data.fit import fit_in_memory
from llmtrain.data.meta import DataMeta
from llmtrain.data.scan import assign_splits, bucket
from llmtrain.data.tokenizers import PretrainedTokenizer, Tokenizer

Example = list[tuple[str, bool]]  # (text, trained) segments: prompt parts untrained, response parts trained


def read_instructions(cfg: DataConfig, files: list[SourceFile]) -> list[tuple[str, bytes]]:
    """Each example as JSON of its (text, trained) segments. Instruction sets are small: in memory."""
    template = chat_template(cfg)
    chat = None if template is None else _renderer(template, cfg.tokenizer_dir or "")
    return [(name, json.dumps(segments).encode()) for f in files
            for name, segments in instruction_examples(f, cfg.prompt_field, cfg.response_field, cfg.messages_field,
                                                       chat)]


def _renderer(template: ChatTemplate, folder: str) -> Callable[[list[dict], str], list[tuple[str, bool]]]:
    from llmtrain.core.errors import ConfigError

    def render(messages: list[dict], where: str) -> list[tuple[str, bool]]:
        try:
            return template.segments(messages)
        except TemplateProblem as err:
            raise ConfigError(
                f"{where}: {err}, so the chat template of {folder} ({template.where}) cannot format this "
                "conversation as the model expects it (the probe conversation rendered fine: the line breaks a rule "
                "of the template, such as roles that must alternate); fix the line, or the template.") from None

    return render


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
    template = chat_template(cfg)
    if template is not None:
        log(f"formatting conversations with the chat template of {cfg.tokenizer_dir} ({template.where}); the first "
            f"example as the model sees it, »trained on«, the rest masked:\n{preview(examples[0])}")
    everyone = bytearray(b"\x01" * len(raw))
    is_val = assign_splits(array("d", (bucket(name) for name, _ in raw)), everyone, cfg.val_fraction)
    tokenizer = fit_in_memory(cfg, [text for ex in examples for text, _ in ex],
                              ["".join(text for text, _ in ex) for ex, v in zip(examples, is_val) if not v], log)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    arrays, counts = {}, {}
    for split, wanted in (("train", 0), ("val", 1)):
        split_examples = [ex for ex, v in zip(examples, is_val) if v == wanted]
        if template is not None:
            assert isinstance(tokenizer, PretrainedTokenizer)  # a chat template comes with the folder's tokenizer
            ids, mask, offsets = _tokenized_whole(split_examples, tokenizer)
        else:
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
        chat_template=None if template is None else {"file": template.where, "sha256": template.sha256,
                                                     "first_example": preview(examples[0])},
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


def _tokenized_whole(examples: list[Example], tokenizer: PretrainedTokenizer) -> tuple[list[int], list[int], list[int]]:
    """As `_tokenized`, for rendered chats: each example tokenized whole (a piece boundary must not
    change the tokens: transformers tokenizes the rendered text at once), a token trained when its
    characters overlap a trained span (as transformers' assistant mask maps spans to tokens)."""
    ids: list[int] = []
    mask: list[int] = []
    offsets = [0]
    for segments in examples:
        spans, at = [], 0
        for text, trained in segments:
            if trained:
                spans.append((at, at + len(text)))
            at += len(text)
        encoding = tokenizer.inner.encode("".join(text for text, _ in segments), add_special_tokens=False)
        ids += encoding.ids
        mask += [int(any(start < b and (end > a or start == end >= a) for a, b in spans))
                 for start, end in encoding.offsets]
        offsets.append(len(ids))
    return ids, mask, offsets
