"""Sampling stops at the end-of-text token unless told not to."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from llmtrain.generation import generate
from llmtrain.model import KVCache


class CountingModel(torch.nn.Module):
    """Predicts token (last + 1) with certainty: 3, 4, 5, ... after a prompt ending in 2."""

    def __init__(self, vocab: int = 16) -> None:
        super().__init__()
        self.cfg = SimpleNamespace(block_size=64)
        self.vocab = vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        logits = torch.full((*idx.shape, self.vocab), -1e9)
        logits.scatter_(2, ((idx + 1) % self.vocab).unsqueeze(-1), 0.0)
        if cache is None:
            return logits
        # GPT.forward's cached call: the count of tokens read grows, the last position's logits come back
        cache.length += idx.shape[1]
        return logits[:, -1:]

    def new_cache(self, capacity: int) -> KVCache:  # generate's cache: no layers, only the count of tokens read
        return KVCache(0, capacity)


def test_generation_ends_after_end_of_text_and_only_then() -> None:
    model = CountingModel()
    assert generate(model, [2], 10, temperature=0, stop_id=6) == [3, 4, 5, 6]
    assert generate(model, [2], 10, temperature=1.0, generator=torch.Generator().manual_seed(0),
                    stop_id=6) == [3, 4, 5, 6]
    assert generate(model, [2], 5, temperature=0, stop_id=None) == [3, 4, 5, 6, 7]
    assert generate(model, [2], 3, temperature=0, stop_id=6) == [3, 4, 5]  # the budget ends first
