"""llmtrain's tokenizers as the files `transformers.AutoTokenizer.from_pretrained(dir)` reads.

Each kind becomes a `tokenizers`-library pipeline that gives the SAME ids as llmtrain's own
`encode` (and decodes back the same way), so an exported model sees the tokens it was trained on:

- byte: a byte-level BPE with no merges (GPT-2's byte alphabet, one token per byte); byte 255,
  which never occurs in UTF-8, is `<|endoftext|>`;
- char: a BPE with no merges and no pre-tokenizer (one token per character, any whitespace kept),
  decoded by concatenation (Fuse); `<|endoftext|>` is the id after the characters;
- bpe: the trained `tokenizers` JSON, as it is;
- tiktoken (GPT-2's BPE): the ranks as a byte-level BPE vocabulary with the merges that produce
  them, GPT-2's pre-tokenizer regex, and tiktoken's whole-piece lookup (`ignore_merges`);
- pretrained: the folder's tokenizer.json, as it is but for a post-processor template that adds
  tokens (a Llama tokenizer's <s>): llmtrain trained without them, so AutoTokenizer adds none.

The one difference HF tokenizers cannot avoid: the text "<|endoftext|>" typed literally encodes
as the special token, where llmtrain's data preparation (every tokenizer kind) encodes its characters.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from llmtrain.core.errors import ConfigError

END_OF_TEXT = "<|endoftext|>"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"


@dataclass(frozen=True)
class HFTokenizer:
    """A tokenizers-library JSON and its special tokens (strings and ids; None when there is none)."""

    tokenizer: dict[str, Any]  # tokenizer.json, parsed
    eos: str | None
    eos_id: int | None
    bos: str | None
    bos_id: int | None


def hf_tokenizer(data: dict[str, Any]) -> HFTokenizer:
    """The HF tokenizer of an llmtrain tokenizer, given as its `to_dict()` (a run's tokenizer.json)."""
    kind = data.get("kind")
    if kind == "byte":
        return _byte()
    if kind == "char":
        return _char(list(data["chars"]), bool(data.get("end_of_text", False)))
    if kind == "bpe":
        return _as_is(data["tokenizer"], eos=END_OF_TEXT)
    if kind == "tiktoken":
        return _tiktoken(data)
    if kind == "pretrained":
        return _as_is(data["tokenizer"], eos_id=data.get("eos_id"), bos_id=data.get("bos_id"))
    raise ConfigError(f"tokenizer kind {kind!r} has no Hugging Face form; llmtrain exports byte, char, bpe, tiktoken "
                      "(gpt2) and pretrained tokenizers.")


def tokenizer_files(data: dict[str, Any], context: int) -> tuple[HFTokenizer, dict[str, str]]:
    """(the HF tokenizer, {file name: text}) for tokenizer.json, tokenizer_config.json and
    special_tokens_map.json; `context` becomes model_max_length."""
    tok = hf_tokenizer(data)
    specials = {k: v for k, v in (("bos_token", tok.bos), ("eos_token", tok.eos)) if v is not None}
    config = {
        # The generic tokenizers-backed class: it runs tokenizer.json as written, whatever config.json's model_type.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context,
        # llmtrain adds no token to a text it encodes (documents only END with end-of-text).
        "add_bos_token": False, "add_eos_token": False,
        # Decoding is exact: no space clean-up (" ." stays " ."), as llmtrain's decode.
        "clean_up_tokenization_spaces": False,
        **specials,
    }
    files = {TOKENIZER: json.dumps(tok.tokenizer, ensure_ascii=False), TOKENIZER_CONFIG: json.dumps(config, indent=2),
             SPECIAL_TOKENS_MAP: json.dumps(specials, indent=2)}
    return tok, files


def _finish(inner: Any, eos: str | None, bos: str | None = None) -> HFTokenizer:
    """Register `eos` as a special token (its id is the one the vocabulary gives it) and freeze."""
    from tokenizers import AddedToken

    if eos is not None:
        inner.add_special_tokens([AddedToken(eos, special=True, normalized=False)])
    return HFTokenizer(json.loads(inner.to_str()), eos, _id(inner, eos), bos, _id(inner, bos))


def _id(inner: Any, token: str | None) -> int | None:
    return None if token is None else inner.token_to_id(token)


def _byte() -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from llmtrain.data.tokenizers import ByteTokenizer, byte_level_chars

    vocab = {char: byte for char, byte in byte_level_chars().items() if byte != ByteTokenizer.eos_id}
    vocab[END_OF_TEXT] = ByteTokenizer.eos_id
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: bytes are tokens, so where words break cannot change the ids.
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    # bos = eos, as GPT-2: a document starts after an end-of-text, so it is the natural first token.
    return _finish(inner, END_OF_TEXT, END_OF_TEXT)


def _char(chars: list[str], end_of_text: bool) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models

    vocab = {c: i for i, c in enumerate(chars)}
    # The text is one "word" (no pre-tokenizer): BPE splits it into characters, and with no merges
    # each character is its own token, spaces and newlines included.
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.decoder = decoders.Fuse()  # tokens joined as they are (the default decoder puts spaces between)
    # Added after the characters: id len(chars), as llmtrain's; no single character can be this name.
    eos = END_OF_TEXT if end_of_text else None
    return _finish(inner, eos, eos)


def _as_is(tokenizer: dict[str, Any], eos: str | None = None, eos_id: int | None = None,
           bos_id: int | None = None) -> HFTokenizer:
    """A tokenizers JSON kept as written; the special tokens named by string or by id."""
    from tokenizers import Tokenizer

    tokenizer = _without_added_tokens(tokenizer)
    inner = Tokenizer.from_str(json.dumps(tokenizer))
    eos_id = inner.token_to_id(eos) if eos is not None else eos_id
    eos = inner.id_to_token(eos_id) if eos_id is not None else None
    bos = inner.id_to_token(bos_id) if bos_id is not None else eos  # bos = eos when there is none (GPT-2's way)
    return HFTokenizer(tokenizer, eos, eos_id, bos, bos_id if bos_id is not None else eos_id)


def _without_added_tokens(tokenizer: dict[str, Any]) -> dict[str, Any]:
    """`tokenizer` without a post-processor template that adds tokens (a Llama tokenizer's <s>):
    llmtrain encodes without them, and transformers, finding no post-processor, adds none either
    (add_bos_token false). A ByteLevel post-processor only trims offsets, and stays."""
    processor = tokenizer.get("post_processor")
    if not isinstance(processor, dict) or processor.get("type") == "ByteLevel":
        return tokenizer
    kept = [p for p in processor.get("processors", []) if p.get("type") == "ByteLevel"]
    return {**tokenizer, "post_processor": kept[0] if kept else None}


def _tiktoken(data: dict[str, Any]) -> HFTokenizer:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from llmtrain.data.tokenizers import GPT2_SPLIT_PATTERN, byte_level_chars

    if data["pat_str"] != GPT2_SPLIT_PATTERN:
        raise ConfigError(f"the tiktoken tokenizer {data.get('name')!r} splits text with a regex other than GPT-2's; "
                          "only GPT-2's BPE (data.tokenizer=gpt2) is exported to Hugging Face.")
    ranks = {base64.b64decode(token): rank for token, rank in data["ranks"]}
    char_of = {byte: char for char, byte in byte_level_chars().items()}

    def text(token: bytes) -> str:
        return "".join(char_of[b] for b in token)

    specials = {str(name): int(token_id) for name, token_id in data["special_tokens"].items()}
    # The special tokens sit in the vocabulary at tiktoken's ids (add_special_tokens keeps an id it finds there).
    vocab = {text(token): rank for token, rank in ranks.items()} | specials
    merges = [(text(a), text(b)) for a, b in derive_merges(ranks)]
    # ignore_merges: a pre-tokenized piece that is a whole token is that token, as in tiktoken.
    inner = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    eos = END_OF_TEXT if END_OF_TEXT in specials else None
    return HFTokenizer(json.loads(inner.to_str()), eos, specials.get(END_OF_TEXT), eos, specials.get(END_OF_TEXT))


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The BPE merges that rebuild tiktoken's ranks: for each multi-byte token, in rank order, the
    two parts BPE with only the lower ranks leaves it in (the last merge that makes it)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            parts = _bpe(ranks, token, rank)
            if len(parts) == 2:  # else no merge makes it: ignore_merges still finds it whole
                merges.append((parts[0], parts[1]))
    return merges


def _bpe(ranks: dict[bytes, int], token: bytes, below: int) -> list[bytes]:
    """`token`'s bytes merged as tiktoken does (lowest rank first), with ranks under `below` only."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], below))
        if ranks.get(parts[best] + parts[best + 1], below) >= below:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts
