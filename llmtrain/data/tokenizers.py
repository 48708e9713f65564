"""Tokenizers that travel with the prepared data (and into the run dir, for `sample`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def to_dict(self) -> dict: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train, lossless."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return {"kind": "byte"}


class CharTokenizer:
    """One token per distinct character of the corpus; vocabulary from the data, sorted."""

    def __init__(self, chars: list[str]) -> None:
        self.chars = chars
        self.index = {c: i for i, c in enumerate(chars)}
        self.vocab_size = len(chars)

    @classmethod
    def fit(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    def encode(self, text: str) -> list[int]:
        try:
            return [self.index[c] for c in text]
        except KeyError as err:
            known = "".join(self.chars[:40])
            raise ValueError(
                f"character {err.args[0]!r} is not in this char tokenizer's vocabulary "
                f"({self.vocab_size} characters, starting {known!r})"
            ) from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_dict(self) -> dict:
        return {"kind": "char", "chars": self.chars}


def tokenizer_from_dict(data: dict) -> Tokenizer:
    if data["kind"] == "byte":
        return ByteTokenizer()
    if data["kind"] == "char":
        return CharTokenizer(list(data["chars"]))
    raise ValueError(f"unknown tokenizer kind {data['kind']!r}; valid: byte, char")


def save_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    path.write_text(json.dumps(tokenizer.to_dict(), ensure_ascii=False))


def load_tokenizer(path: Path) -> Tokenizer:
    return tokenizer_from_dict(json.loads(path.read_text()))
