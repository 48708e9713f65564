"""What a model needs before tensor parallel can split it: whole attention heads per process, a
vocabulary and MLP width the processes share evenly, sequences sequence parallel can slice, and
what torch cannot run on split weights. Pure (the standard library and the config), so `validate`
refuses a layout before any process starts; llmtrain/distributed/tensor_parallel.py checks again
with the model's padded vocabulary."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from llmtrain.config.catalog import mlp_hidden
from llmtrain.config.schema import ModelConfig


def tensor_parallel_problems(model_cfg: ModelConfig, vocab_size: int | None, tp: int, sequence_parallel: bool,
                             seq_len: int | Sequence[int] | None, *, optimizer: str | None = None) -> list[str]:
    """Why this model cannot be split across `tp` processes, one user-facing sentence each ([] when it
    can). `vocab_size` is the model's vocabulary after padding (None: not known yet, not checked);
    `seq_len` the sequence length(s) the run uses (every stage of a schedule; None: not checked);
    `optimizer` the optim.name (None: not checked)."""
    if tp < 1:
        return [f"parallel.tp is {tp}; use the number of processes each layer is split across (>= 1)."]
    if tp == 1:
        return []
    problems = [*_head_problems(model_cfg, tp), *_width_problems(model_cfg, vocab_size, tp)]
    lengths = [seq_len] if isinstance(seq_len, int) else list(seq_len or [])
    if sequence_parallel:
        for length in dict.fromkeys(lengths):  # each length once, in order
            if length % tp:
                problems.append(
                    f"the sequence length {length} is not divisible by tp={tp}: sequence parallel splits every "
                    f"sequence into {tp} equal slices; use a length that is a multiple of {tp} "
                    f"(e.g. {_round_up(length, tp)}), or drop parallel.sequence_parallel.")
    if model_cfg.dropout > 0:
        # Dropout runs on the processes' plain local tensors, each drawing from its own generator
        # (seeded alike on every rank): copies of one activation (replicated) stay identical only as
        # long as every generator advances in step, and the pieces of one activation (a process's
        # heads, its slice of the sequence) get copies of the same mask instead of independent ones.
        # Neither trains like one process, and DTensor's own RNG tracking does not reach these tensors.
        problems.append(
            f"model.dropout is {model_cfg.dropout}, but tensor parallel (tp={tp}) needs model.dropout=0: each "
            "process would draw its own dropout masks for its piece of the activations, which does not train "
            "like one process; set model.dropout=0 or use tp=1.")
    if optimizer is not None and str(getattr(optimizer, "value", optimizer)) == "adafactor":
        # torch 2.13: Adafactor's factored second moment of a split matrix is a norm over the split
        # dimension, which DTensor cannot update in place (aten.pow_ on a _NormPartial placement).
        problems.append(f"optim.name is adafactor, which torch cannot step on tensor-parallel (split) weights "
                        f"(tp={tp}); use optim.name=adamw, adam or sgd, or tp=1.")
    return problems


def _head_problems(m: ModelConfig, tp: int) -> list[str]:
    out = []
    counts = [("model.n_head", m.n_head)]
    if m.n_kv_head not in (None, m.n_head):  # null: as many as n_head, refused once above
        counts.append(("model.n_kv_head", m.n_kv_head))
    for key, count in counts:
        if count % tp:
            out.append(f"{key} is {count}, which tp={tp} does not divide: tensor parallel gives each process whole "
                       f"attention heads; use a tp that divides {count} ({_divisors(count)}).")
    return out


def _width_problems(m: ModelConfig, vocab_size: int | None, tp: int) -> list[str]:
    out = []
    if vocab_size is not None and vocab_size % tp:
        if m.vocab_size is None:  # the data's vocabulary, padded up to model.vocab_multiple
            fix = (f"set model.vocab_multiple={math.lcm(max(m.vocab_multiple, 1), tp)} (a multiple of {tp}), which "
                   "pads the vocabulary with ids that are never targets")
        else:
            fix = f"set model.vocab_size to a multiple of {tp} (e.g. {_round_up(vocab_size, tp)})"
        out.append(f"the model's vocabulary of {vocab_size} ids is not divisible by tp={tp}: the embedding and the "
                   f"head are split by vocabulary rows across the processes; {fix}.")
    width = mlp_hidden(dataclasses.asdict(m))
    if width % tp:
        out.append(f"the MLP's hidden width is {width}, which tp={tp} does not divide: each process holds an equal "
                   f"slice of it; set model.intermediate_size to a multiple of {tp} (e.g. {_round_up(width, tp)}).")
    return out


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k
