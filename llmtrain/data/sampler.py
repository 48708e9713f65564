"""Window batches gathered from a memory-mapped token file: random windows, or epochs.

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
    """With `world_size` > 1 every rank draws the windows of all ranks from the same generator and
    keeps its own slice: the ranks' batches are disjoint, and together they are exactly the batch
    one process would draw (so a DDP run sees the single-process data, and resumes on any world
    size from the same generator state)."""

    def __init__(
        self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, shuffle: bool = True,
        overfit_batches: int = 0, rank: int = 0, world_size: int = 1,
    ) -> None:
        if tokens.size < seq_len + 1:
            raise ValueError(f"{tokens.size} tokens cannot fill one window of {seq_len + 1}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.shuffle = shuffle
        self.overfit_batches = overfit_batches
        self.rank, self.world_size = rank, world_size
        self.rng = np.random.default_rng(seed)
        self._initial_rng_state = self.rng.bit_generator.state
        self.cursor = 0  # unshuffled: the next window's index
        self.batches_drawn = 0
        self._offsets = np.arange(seq_len + 1)

    def reshape(self, batch_size: int, seq_len: int) -> None:
        """Draw batches of another shape from here on (a sequence-length schedule's next stage); the
        generator goes on, so a resumed run that reshapes at the same step draws the same windows."""
        if self.tokens.size < seq_len + 1:
            raise ValueError(f"{self.tokens.size} tokens cannot fill one window of {seq_len + 1}")
        self.batch_size, self.seq_len = batch_size, seq_len
        self._offsets = np.arange(seq_len + 1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, both int64 of shape (batch_size, seq_len)."""
        if self.overfit_batches and self.batches_drawn % self.overfit_batches == 0:
            self.rng.bit_generator.state = self._initial_rng_state  # replay from the first batch
            self.cursor = 0
        self.batches_drawn += 1
        n_starts = self.tokens.size - self.seq_len
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        if self.shuffle:
            # One float64 draw per window (no rejection sampling, no buffered bits): drawing 8 windows
            # at once gives the same windows as drawing 2 four times, so the data of a step does not
            # depend on how it is split into micro-batches, or over how many processes.
            starts = (self.rng.random(self.batch_size * self.world_size) * n_starts).astype(np.int64)[mine]
        else:
            windows_per_pass = max(1, n_starts // self.seq_len)
            index = self.cursor + np.arange(self.batch_size * self.world_size)[mine]
            starts = (index % windows_per_pass) * self.seq_len
            self.cursor += self.batch_size * self.world_size
        windows = torch.from_numpy(self.tokens[starts[:, None] + self._offsets].astype(np.int64))
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {
            "bit_generator": self.rng.bit_generator.state, "cursor": self.cursor, "batches_drawn": self.batches_drawn
        }

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["bit_generator"]
        self.cursor = state.get("cursor", 0)
        self.batches_drawn = state.get("batches_drawn", 0)


class EpochOrder:
    """Items (windows, examples) visited once per epoch in a permutation drawn from (seed, epoch).

    The permutation is read in blocks of batch_size x world_size items; rank r takes the r-th
    batch of each block, so the ranks' shards are disjoint and cover the epoch, and together they
    consume the permutation in order whatever the world size. The epoch is cut to a multiple of
    `epoch_multiple` items (default: one block; the loop passes the global batch, so an epoch ends
    on a step and is the same for any world size): drop_last. (epoch, cursor) is the whole state,
    the cursor counting the items of all ranks, so a run resumes on another world size exactly."""

    def __init__(self, n_items: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 epoch_multiple: int | None = None) -> None:
        self.n_items, self.batch_size, self.seed = n_items, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.block = batch_size * world_size
        self.multiple = epoch_multiple or self.block
        if self.multiple % self.block:
            raise ValueError(f"an epoch multiple of {self.multiple} items is not whole blocks of {self.block}")
        self.epoch = 0
        self.cursor = 0  # items of the epoch already served, all ranks together
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        order = np.random.default_rng([self.seed, epoch]).permutation(self.n_items)
        return order[: len(order) - len(order) % self.multiple]  # drop_last

    def next_items(self) -> np.ndarray:
        if self.cursor + self.block > len(self._order):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        start = self.cursor + self.rank * self.batch_size
        self.cursor += self.block
        return self._order[start:start + self.batch_size]

    @property
    def epochs_done(self) -> float:
        """Epochs completed, fractional: 1.5 = half-way through the second epoch."""
        return self.epoch + self.cursor / max(1, len(self._order))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)


class EpochSampler(EpochOrder):
    """Epochs over non-overlapping windows: the token stream (documents packed back to back) is cut
    into windows of `seq_len + 1` tokens (neighbours share their boundary token as a target), visited
    in EpochOrder. The position lives in `state_dict`, so a resumed run continues mid-epoch with
    exactly the batches it would have seen."""

    def __init__(
        self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, rank: int = 0, world_size: int = 1,
        epoch_multiple: int | None = None,
    ) -> None:
        n_windows = (tokens.size - 1) // seq_len
        needed = epoch_multiple or batch_size * world_size
        if n_windows < needed:
            raise ValueError(
                f"{tokens.size} tokens make {n_windows} windows of {seq_len + 1}, fewer than one step's {needed}"
            )
        super().__init__(n_windows, batch_size, seed, rank, world_size, epoch_multiple)
        self.tokens, self.seq_len = tokens, seq_len
        self._offsets = np.arange(seq_len + 1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.next_items() * self.seq_len
        windows = torch.from_numpy(self.tokens[starts[:, None] + self._offsets].astype(np.int64))
        return windows[:, :-1], windows[:, 1:]


IGNORE_INDEX = -100  # targets the loss skips (same value as torch's cross_entropy default)


class InstructionSampler(EpochOrder):
    """Whole instruction examples, one per row, in EpochOrder, each cut to `seq_len + 1` tokens and
    right-padded. Targets are IGNORE_INDEX where the loss mask is 0 (prompt tokens) and on padding,
    so only response tokens are trained on. Causal attention with right padding needs no attention
    mask: a real token never attends to a later (padded) position."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, offsets: np.ndarray, batch_size: int, seq_len: int,
                 seed: int, rank: int = 0, world_size: int = 1, epoch_multiple: int | None = None) -> None:
        n_examples = len(offsets) - 1
        needed = epoch_multiple or batch_size * world_size
        if n_examples < needed:
            raise ValueError(f"{n_examples} examples are fewer than one step's {needed}")
        super().__init__(n_examples, batch_size, seed, rank, world_size, epoch_multiple)
        self.tokens, self.mask, self.offsets, self.seq_len = tokens, mask, offsets, seq_len

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(self.batch_size, self.seq_len, dtype=torch.int64)
        y = torch.full((self.batch_size, self.seq_len), IGNORE_INDEX, dtype=torch.int64)
        for row, example in enumerate(self.next_items()):
            start = int(self.offsets[example])
            end = min(int(self.offsets[example + 1]), start + self.seq_len + 1)
            ids = torch.from_numpy(self.tokens[start:end].astype(np.int64))
            trained = torch.from_numpy(self.mask[start + 1:end].astype(bool))
            n = len(ids) - 1
            x[row, :n] = ids[:-1]
            y[row, :n] = torch.where(trained, ids[1:], IGNORE_INDEX)
        return x, y
