"""Choosing or fitting the tokenizer a build encodes with.

`fit_tokenizer` fits on a streamed corpus (char: every character; bpe: a sample of the train
split), `fit_in_memory` on instruction examples; both load GPT-2's files (`gpt2_tokenizer`, logging
files that are not the published ones) or a pretrained folder's tokenizer.json (`logged_pretrained`,
logging its vocabulary and end-of-text token); byte needs nothing."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator

from llmtrain.config.schema import DataConfig, TokenizerKind
from llmtrain.data.cache import gpt2_files_of, pretrained_tokenizer
from llmtrain.data.corpus import SourceFile
from llmtrain.data.progress import ProgressBar
from llmtrain.data.scan import Scan, split_pieces
from llmtrain.data.tokenizers import (
    GPT2_SHA256,
    GPT2_URL,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    PretrainedTokenizer,
    Tokenizer,
    gpt2_tokenizer,
)


def gpt2_tokenizer_of(cfg: DataConfig, log: Callable[[str], None]) -> Tokenizer:
    """data.tokenizer=gpt2: GPT-2's BPE from its two files (used as given when they are not the
    published ones, with a log line saying so)."""
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


def logged_pretrained(cfg: DataConfig, log: Callable[[str], None]) -> PretrainedTokenizer:
    """data.tokenizer=pretrained: data.tokenizer_dir's tokenizer, its vocabulary and end-of-text logged."""
    tokenizer = pretrained_tokenizer(cfg)
    end = tokenizer.inner.id_to_token(tokenizer.eos_id)
    log(f"tokenizer.json of {cfg.tokenizer_dir}: vocabulary {tokenizer.vocab_size:,}, end-of-text {end} "
        f"(id {tokenizer.eos_id}, from {tokenizer.eos_origin or 'the saved tokenizer'})")
    return tokenizer


def fit_tokenizer(
    cfg: DataConfig, files: list[SourceFile], scan: Scan, keep: bytearray, is_val: bytearray, tail_cut: int | None,
    log: Callable[[str], None], bar: ProgressBar,
) -> Tokenizer:
    """char: every character of the corpus (both splits: validation must encode too); bpe: trained on
    the train split, on at most data.bpe_sample_bytes of it spread over its documents; byte, gpt2
    and pretrained (a model folder's tokenizer.json): nothing to fit."""
    if cfg.tokenizer is TokenizerKind.byte:
        return ByteTokenizer()
    if cfg.tokenizer is TokenizerKind.gpt2:
        return gpt2_tokenizer_of(cfg, log)
    if cfg.tokenizer is TokenizerKind.pretrained:
        return logged_pretrained(cfg, log)
    if cfg.tokenizer is TokenizerKind.char:
        characters: set[str] = set()
        bar.start("collecting characters", sum(scan.sizes[i] for i, k in enumerate(keep) if k))
        for _, text, _ in split_pieces(cfg, files, scan, keep, is_val, tail_cut):
            characters.update(text.decode("utf-8") if isinstance(text, bytes) else text)
            bar.advance(len(text))
        return CharTokenizer.fit(characters)
    return _fit_bpe(cfg, files, scan, keep, is_val, tail_cut, log, bar)


def _fit_bpe(
    cfg: DataConfig, files: list[SourceFile], scan: Scan, keep: bytearray, is_val: bytearray, tail_cut: int | None,
    log: Callable[[str], None], bar: ProgressBar,
) -> Tokenizer:
    """A byte-level BPE trained on every stride-th train document, until data.bpe_sample_bytes are read:
    the sample spreads over the whole train split, not its first files."""
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
        for split, text, end in split_pieces(cfg, files, scan, keep, is_val, tail_cut):
            if split == "train" and document % stride == 0:
                budget -= len(text)
                bar.advance(len(text), documents=int(end))
                yield text.decode("utf-8") if isinstance(text, bytes) else text
                if budget <= 0:
                    return
            document += int(end and split == "train")

    return BPETokenizer.fit(sample(), cfg.bpe_vocab_size)


def fit_in_memory(
    cfg: DataConfig, all_texts: list[str], train_texts: list[str], log: Callable[[str], None]
) -> Tokenizer:
    """Instruction data (small, in memory): char from every text, bpe trained on the train split's."""
    if cfg.tokenizer is TokenizerKind.char:
        return CharTokenizer.fit(set().union(*map(set, all_texts)))
    if cfg.tokenizer is TokenizerKind.bpe:
        log(f"training a byte-level BPE tokenizer (vocabulary {cfg.bpe_vocab_size}) on the train split")
        return BPETokenizer.fit(iter(train_texts), cfg.bpe_vocab_size)
    if cfg.tokenizer is TokenizerKind.gpt2:
        return gpt2_tokenizer_of(cfg, log)
    if cfg.tokenizer is TokenizerKind.pretrained:
        return logged_pretrained(cfg, log)
    return ByteTokenizer()


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KB"
