"""What each layout costs one device: memory (preflight/estimate.py's estimate_layout, with and
without activation checkpointing), the communication it adds per optimizer step, and, for
pipelines, the bubble.

Communication is counted as bytes each device sends per optimizer step over ring collectives
(an all-reduce of S bytes over n ranks sends 2(n-1)/n x S from each; an all-gather or a
reduce-scatter (n-1)/n x S):

    ddp        all-reduce of the gradients (fp32), once per step (accumulation holds it: no_sync)
    zero1      the same, plus the updated parameter shards sent to every rank
    fsdp       all-gather of the parameters (compute dtype) in forward and again in backward, every
               micro-batch; reduce-scatter of the gradients (fp32) once per step
    hsdp       fsdp within a shard group, then an all-reduce of each gradient shard across the replicas
    tp         all-reduce of a block's output activations (micro-batch x sequence x width), two per
               layer forward (after attention, after the MLP) and two backward; checkpointing
               recomputes the forward: two more. With sequence parallelism each all-reduce is a
               reduce-scatter and an all-gather: the same bytes
    pp         each stage sends its activations forward and receives their gradients back, per
               micro-batch; the pipeline idles (stages - 1) / (micro-batches + stages - 1) of a step
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.config.derived import derived_micro_batch_size, micro_batch_size_derived, seq_len_of
from llmtrain.config.schema import Config, Precision
from llmtrain.plan.layouts import Layout
from llmtrain.plan.target import Target
from llmtrain.preflight.estimate import LayoutDegrees, MemoryEstimate, device_share, estimate_layout


@dataclass(frozen=True)
class Transfer:
    """One collective a layout runs: bytes each device sends per optimizer step."""

    collective: str  # all-reduce, all-gather, reduce-scatter, send/receive
    what: str  # what it moves: "gradients", "activations x4/layer"
    bytes: float


@dataclass(frozen=True)
class Batching:
    """How a layout splits the global batch: micro-batches of `micro` sequences per data-parallel
    rank, `accumulation` of them per optimizer step; `global_batch` is the config's, or the next
    multiple of micro x data-parallel ranks when the config's does not split over them."""

    micro: int
    accumulation: int
    global_batch: int
    changed: bool  # global_batch is not the config's


@dataclass(frozen=True)
class LayoutCost:
    layout: Layout
    batching: Batching
    plain: MemoryEstimate  # without activation checkpointing
    checkpointed: MemoryEstimate  # with it
    transfers_plain: tuple[Transfer, ...]
    transfers_checkpointed: tuple[Transfer, ...]
    bubble: float | None  # the idle fraction of a pipeline's step; None without stages

    def memory(self, checkpointing: bool) -> MemoryEstimate:
        return self.checkpointed if checkpointing else self.plain

    def transfers(self, checkpointing: bool) -> tuple[Transfer, ...]:
        return self.transfers_checkpointed if checkpointing else self.transfers_plain

    def traffic(self, checkpointing: bool) -> float:
        """Bytes a device sends per optimizer step, all collectives together."""
        return sum(t.bytes for t in self.transfers(checkpointing))


def batching(target: Target, degrees: LayoutDegrees, micro: int | None = None) -> Batching:
    """The micro-batch and accumulation of each data-parallel rank: an explicit micro_batch_size is
    kept; a derived one (null in the config) is derived again for this many ranks, as train would."""
    cfg, dp = target.cfg, degrees.data_parallel
    if micro is None and degrees.pp > 1 and not explicit_micro_batch(cfg):
        # A pipeline's micro-batches are the window's: parallel.pp_microbatches (the pp preset's 4), at
        # least one per stage, the smallest such count that divides each data-parallel rank's batch.
        per_rank = max(cfg.global_batch_size // dp, 1)
        want = max(degrees.pp, cfg.parallel.pp_microbatches or PIPELINE_MICROBATCHES)
        counts = [k for k in range(want, per_rank + 1) if per_rank % k == 0]
        micro = per_rank // counts[0] if counts else 1
    if micro is None:
        micro = explicit_micro_batch(cfg) or derived_micro_batch_size(cfg.global_batch_size, dp)
    per_pass = micro * dp
    global_batch = -(-cfg.global_batch_size // per_pass) * per_pass
    if degrees.pp > 1:  # at least one micro-batch per stage in flight
        global_batch = max(global_batch, degrees.pp * per_pass)
    return Batching(micro, global_batch // per_pass, global_batch, global_batch != cfg.global_batch_size)


PIPELINE_MICROBATCHES = 4  # conf/parallel/pp.yaml's parallel.pp_microbatches


def explicit_micro_batch(cfg: Config) -> int | None:
    """The config's micro_batch_size when it sets one (None: null, derived per world size)."""
    return cfg.micro_batch_size if cfg.micro_batch_size is not None and not micro_batch_size_derived(cfg) else None


def memory(target: Target, layout: Layout, checkpointing: bool, batch: Batching) -> MemoryEstimate:
    """One device's memory in `layout`: the estimate `llmtrain check` shows, for these degrees."""
    return estimate_layout(target.cfg, target.shape, target.vocab_size, target.device_type, target.precision,
                           layout.degrees, checkpointing=checkpointing, micro_batch_size=batch.micro,
                           accumulation=batch.accumulation, runtime_bytes=target.runtime_bytes,
                           data_bytes=target.data_bytes)


def ring(n: int) -> float:
    """The share of a buffer each rank sends in a ring all-gather or reduce-scatter over n ranks."""
    return (n - 1) / n


def transfers(target: Target, layout: Layout, checkpointing: bool, batch: Batching) -> tuple[Transfer, ...]:
    d = layout.degrees
    low = target.precision in (Precision.bf16, Precision.fp16)
    compute_bytes = 2 if low else 4
    params = device_share(target.shape, d).params  # this tp/pp rank's part, before data-parallel sharding
    grads = 4.0 * params  # gradients are reduced in fp32
    out: list[Transfer] = []
    if d.dp_shard > 1:
        gathers = 2 * batch.accumulation  # forward and backward, every micro-batch
        out.append(Transfer("all-gather", f"parameters x{gathers}",
                            gathers * ring(d.dp_shard) * compute_bytes * params))
        out.append(Transfer("reduce-scatter", "gradients", ring(d.dp_shard) * grads))
        if d.dp_replicate > 1:
            out.append(Transfer("all-reduce", "shards' gradients",
                                2 * ring(d.dp_replicate) * grads / d.dp_shard))
    elif d.dp_replicate > 1:
        out.append(Transfer("all-reduce", "gradients", 2 * ring(d.dp_replicate) * grads))
        if d.zero1:
            out.append(Transfer("all-gather", "updated shards", ring(d.dp_replicate) * 4.0 * params))
    activation = batch.micro * seq_len_of(target.cfg) * target.cfg.model.n_embd * compute_bytes
    if d.tp > 1:
        per_layer = 6 if checkpointing else 4
        layers = device_share(target.shape, d).layers
        collective = "reduce-scatter + all-gather" if d.sequence_parallel else "all-reduce"
        out.append(Transfer(collective, f"activations x{per_layer}/layer",
                            per_layer * layers * batch.accumulation * 2 * ring(d.tp) * activation))
    if d.pp > 1:
        out.append(Transfer("send/receive", "activations",
                            2 * batch.accumulation * activation))
    return tuple(out)


def bubble(degrees: LayoutDegrees, batch: Batching) -> float | None:
    """The share of a pipeline's step its stages idle: (stages - 1) / (micro-batches + stages - 1)."""
    if degrees.pp == 1:
        return None
    return (degrees.pp - 1) / (batch.accumulation + degrees.pp - 1)


def cost(target: Target, layout: Layout, micro: int | None = None) -> LayoutCost:
    batch = batching(target, layout.degrees, micro)
    return LayoutCost(
        layout=layout, batching=batch,
        plain=memory(target, layout, False, batch), checkpointed=memory(target, layout, True, batch),
        transfers_plain=transfers(target, layout, False, batch),
        transfers_checkpointed=transfers(target, layout, True, batch),
        bubble=bubble(layout.degrees, batch),
    )
