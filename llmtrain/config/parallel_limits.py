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


# ---- pipeline parallel -----------------------------------------------------------------------------

# torch.distributed.pipelining's schedules llmtrain/distributed/pipeline.py builds
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def pipeline_virtual_stages(schedule: str) -> int:
    """Stages each pipeline process holds: 2 under interleaved_1f1b (torch's looped placement: process r
    holds stages r and r + pp), 1 under the others."""
    return 2 if schedule == "interleaved_1f1b" else 1


def pipeline_problems(model_cfg: ModelConfig, pp: int, schedule: str, n_microbatches: int, *, tp: int = 1,
                      fp16_loss_scaling: bool = False) -> list[str]:
    """Why this model cannot be split into a pipeline of `pp` processes running `schedule` over
    `n_microbatches` micro-batches per optimizer step (the gradient accumulation steps), one
    user-facing sentence each ([] when it can). `tp`: the tensor-parallel degree (a pipeline of
    tensor-parallel stages is not built); `fp16_loss_scaling`: the run scales an fp16 loss (GradScaler)."""
    if pp < 1:
        return [f"parallel.pp is {pp}; use the number of pipeline processes the model's layers are split across "
                "(>= 1)."]
    if pp == 1:
        return []
    if schedule not in PIPELINE_SCHEDULES:
        return [f"the pipeline schedule '{schedule}' is unknown; use one of {', '.join(PIPELINE_SCHEDULES)}."]
    problems = [*_stage_problems(model_cfg, pp, schedule), *_microbatch_problems(pp, schedule, n_microbatches)]
    if tp > 1:
        problems.append(f"pipeline parallel (pp={pp}) with tensor parallel (tp={tp}) is not supported: the stages are "
                        "plain modules, not tensor-parallel ones; use pp=1 or tp=1.")
    if fp16_loss_scaling:
        # Each stage's GradScaler would find overflows in its own gradients only: one process could skip
        # a step another applies, and the stages' copies of the model would drift apart.
        problems.append(f"fp16 with loss scaling is not supported under pipeline parallel (pp={pp}): each stage "
                        "would judge overflow on its own gradients and the stages could disagree on skipping a "
                        "step; use precision bf16 (or fp32), or pp=1.")
    if model_cfg.dropout > 0:
        # Every process seeds its generator alike, so each stage's first block would draw the masks
        # the first stage's first block draws: dropout correlated across the stages' layers, which
        # one process never does.
        problems.append(f"model.dropout is {model_cfg.dropout}, but pipeline parallel (pp={pp}) needs model.dropout=0: "
                        "every stage would draw the same dropout masks for its layers, which does not train like one "
                        "process; set model.dropout=0 or use pp=1.")
    return problems


def _stage_problems(m: ModelConfig, pp: int, schedule: str) -> list[str]:
    stages = pp * pipeline_virtual_stages(schedule)
    if m.n_layer >= stages:
        return []
    per_process = " (2 per process under interleaved_1f1b)" if stages > pp else ""
    most = m.n_layer // pipeline_virtual_stages(schedule)
    return [f"model.n_layer is {m.n_layer}, fewer than the {stages} pipeline stages{per_process} of pp={pp}: every "
            f"stage holds at least one block; use pp <= {max(most, 1)}"
            f"{', or the gpipe or 1f1b schedule' if stages > pp and m.n_layer >= pp else ''}."]


def _microbatch_problems(pp: int, schedule: str, n: int) -> list[str]:
    if n < pp:
        # torch's 1F1B refuses it outright; under the others some stages would idle for the whole step.
        return [f"{n} micro-batch{'' if n == 1 else 'es'} per optimizer step, fewer than the pp={pp} pipeline "
                "processes: the schedule needs at least one micro-batch per process in flight; make "
                f"global_batch_size / (micro_batch_size x data-parallel processes) at least {pp} (a larger "
                "global_batch_size or a smaller micro_batch_size)."]
    rounds = n // pp
    if schedule == "interleaved_1f1b" and n % rounds:
        # torch's interleaved 1F1B runs the micro-batches in rounds of equal size
        return [f"{n} micro-batches per optimizer step cannot run under interleaved_1f1b with pp={pp}: torch runs "
                f"them in {rounds} rounds of equal size, which {n} is not a multiple of; use a multiple of {pp} "
                f"micro-batches (e.g. {rounds * pp} or {(rounds + 1) * pp}), or the 1f1b schedule."]
    return []
