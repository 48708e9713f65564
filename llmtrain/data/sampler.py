"""Window batches gathered from a memory-mapped token file.

Each batch is `batch_size` windows of `seq_len + 1` tokens. Shuffled (the default), the windows
start at uniformly random offsets drawn from the sampler's own seeded generator, so the data order
does not depend on model init or dropout; unshuffled, they follow each other in corpus order.
Windows are gathered in one vectorized fancy-index on the memmap: the corpus is never loaded into
RAM. `overfit_batches=N` replays the first N batches forever (the overfit-one-batch check).
"""

from __future__ import annotations

import numpy as np
import torch


class RandomWindowSampler:
    def __init__(
        self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, shuffle: bool = True,
        overfit_batches: int = 0,
    ) -> None:
        if tokens.size < seq_len + 1:
            raise ValueError(f"{tokens.size} tokens cannot fill one window of {seq_len + 1}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.shuffle = shuffle
        self.overfit_batches = overfit_batches
        self.rng = np.random.default_rng(seed)
        self._initial_rng_state = self.rng.bit_generator.state
        self.cursor = 0  # unshuffled: the next window's index
        self.batches_drawn = 0
        self._offsets = np.arange(seq_len + 1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, both int64 of shape (batch_size, seq_len)."""
        if self.overfit_batches and self.batches_drawn % self.overfit_batches == 0:
            self.rng.bit_generator.state = self._initial_rng_state  # replay from the first batch
            self.cursor = 0
        self.batches_drawn += 1
        n_starts = self.tokens.size - self.seq_len
        if self.shuffle:
            # One float64 draw per window (no rejection sampling, no buffered bits): drawing 8 windows
            # at once gives the same windows as drawing 2 four times, so the data of a step does not
            # depend on how it is split into micro-batches.
            starts = (self.rng.random(self.batch_size) * n_starts).astype(np.int64)
        else:
            windows_per_pass = max(1, n_starts // self.seq_len)
            index = self.cursor + np.arange(self.batch_size)
            starts = (index % windows_per_pass) * self.seq_len
            self.cursor += self.batch_size
        windows = torch.from_numpy(self.tokens[starts[:, None] + self._offsets].astype(np.int64))
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"bit_generator": self.rng.bit_generator.state, "cursor": self.cursor, "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["bit_generator"]
        self.cursor = state.get("cursor", 0)
        self.batches_drawn = state.get("batches_drawn", 0)
