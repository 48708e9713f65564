"""Random-window batches gathered from a memory-mapped token file.

Each batch is `batch_size` windows of `seq_len + 1` tokens at uniformly random offsets, drawn from
the sampler's own seeded generator (so the data order does not depend on model init or dropout),
and gathered in one vectorized fancy-index on the memmap: the corpus is never loaded into RAM.
"""

from __future__ import annotations

import numpy as np
import torch


class RandomWindowSampler:
    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> None:
        if tokens.size < seq_len + 1:
            raise ValueError(f"{tokens.size} tokens cannot fill one window of {seq_len + 1}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rng = np.random.default_rng(seed)
        self._offsets = np.arange(seq_len + 1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, both int64 of shape (batch_size, seq_len)."""
        # One float64 draw per window (no rejection sampling, no buffered bits): drawing 8 windows
        # at once gives the same windows as drawing 2 four times, so the data of a step does not
        # depend on how it is split into micro-batches.
        n_starts = self.tokens.size - self.seq_len
        starts = (self.rng.random(self.batch_size) * n_starts).astype(np.int64)
        windows = torch.from_numpy(self.tokens[starts[:, None] + self._offsets].astype(np.int64))
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"bit_generator": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["bit_generator"]
