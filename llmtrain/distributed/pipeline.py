"""Pipeline parallelism for GPT over torch.distributed.pipelining: the blocks split into consecutive
stages, each held by one process (two under interleaved 1F1B), the micro-batches of an optimizer
step flowing through them as the schedule (GPipe, 1F1B, interleaved 1F1B) orders.

- Stages keep GPT's names: a stage module holds its pieces under the attribute names GPT uses, its
  blocks in an nn.ModuleDict keyed by their index in the whole model (torchtitan does the same), so
  `blocks.5.attn.qkv.weight` is that on whichever stage holds layer 5, and optimizer groups,
  clipping and checkpoints see the single-process names.
- A tied embedding and head: the first stage's `wte.weight` and the last stage's head are copies of one
  parameter. The last stage holds its copy as `wte.weight` too (an nn.Embedding, with `lm_head.weight`
  tied to it as in GPT), so `build_optimizer` puts both copies in the same group; after each backward
  their gradients are summed across the two stages (`sync_tied_gradients`), so both get the single-
  process gradient and stay equal under the same optimizer. Unsynced, they silently untie.
- The loss: the schedule calls the loss per micro-batch, so `WindowLoss` divides each micro-batch's
  summed cross-entropy by the whole window's token count (set per window), as llmtrain's loop does,
  and torch's own scaling of the gradients by the micro-batch count is off.
- The state views (`PipelineModelState`, `PipelineOptimizerState`, pipeline_state.py) gather the
  stages' states on the pipeline's first process in the plain single-process format.
- With FSDP2 data parallel (`data_mesh`): each stage's blocks, then the stage, `fully_shard`ed over
  the data-parallel sub-mesh (torchtitan's way); torch's PipelineStage turns the gradient sync off
  for every micro-batch's backward and reduce-scatters once per window (its REDUCE_GRAD step). The
  loss is scaled by the data-parallel size (FSDP averages), the tied copies' gradient shards summed
  pairwise (the first and last stage of one pipeline hold the same shard), the gradient norm summed
  over the shards and the stages.

What torch's pipelining cannot do here: a KV cache (generation gathers the whole model into one
process), and micro-batches of different shapes in one step (every step's shape may differ: a
schedule is built per shape). The refusals a config check makes before any process starts are
llmtrain/config/parallel_limits.py's `pipeline_problems`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager as ContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.checkpointing import run_block
from llmtrain.config.parallel_limits import PIPELINE_SCHEDULES, pipeline_virtual_stages
from llmtrain.data.sampler import IGNORE_INDEX
from llmtrain.distributed.wrapping import local_tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from llmtrain.distributed.pipeline_state import PipelineModelState, PipelineOptimizerState
    from llmtrain.model import GPT

Batch = tuple[torch.Tensor, torch.Tensor]

# Marks the last stage's copy of a tied embedding: the global gradient norm counts it once, on the first stage.
COUNTED_ELSEWHERE = "_pipeline_counted_elsewhere"
# A few shapes' schedules are kept: a sequence-length schedule, a short last window and evaluation add shapes.
_SCHEDULES_KEPT = 6


# ---- the split (pure) ------------------------------------------------------------------------------

def stage_layers(n_layer: int, n_stages: int) -> list[range]:
    """The blocks of each stage, consecutive and as even as possible: every stage n_layer // n_stages,
    and the first n_layer % n_stages stages one more each (the last stage also runs the head and the
    loss, so it is never the one given an extra block unless all are)."""
    if n_stages < 1 or n_layer < n_stages:
        raise ValueError(f"{n_layer} layers cannot be split into {n_stages} stages of at least one block each")
    base, extra = divmod(n_layer, n_stages)
    bounds = [0]
    for stage in range(n_stages):
        bounds.append(bounds[-1] + base + (stage < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def stage_ranks(n_stages: int, pp: int) -> list[int]:
    """The pipeline process (rank in the pipeline group) of each stage: stage s on s % pp, the looped
    placement torch's interleaved schedule expects (one stage each when n_stages == pp)."""
    if n_stages % pp:
        raise ValueError(f"{n_stages} stages do not spread evenly over {pp} processes")
    return [stage % pp for stage in range(n_stages)]


def rank_stage_indices(pp: int, rank: int, schedule: str) -> list[int]:
    """The stages pipeline process `rank` holds under `schedule`: [rank], or [rank, rank + pp] interleaved."""
    _check_schedule(schedule)
    return [rank + pp * v for v in range(pipeline_virtual_stages(schedule))]


def _check_schedule(kind: str) -> None:
    if kind not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule '{kind}'; use one of {', '.join(PIPELINE_SCHEDULES)}")


# ---- stage modules ---------------------------------------------------------------------------------

class StageModule(nn.Module):
    """One stage of a GPT under GPT's own attribute names: the first holds `wte` (+ `wpe`, `drop`) and
    its blocks, a middle one its blocks, the last its blocks, `norm_f` and `lm_head` (and, tied, the
    embedding's copy as `wte` with `lm_head.weight` tied to it). Forward: token ids (first stage) or
    hidden states (B, T, n_embd) in; hidden states, or logits (last stage) out, as GPT computes them.
    Its parameters are copies of `model`'s (built from an initialized GPT, every process starts where
    one process would); `model` can be dropped afterwards. `autocast` (a context factory) wraps the
    forward, so the schedule's backward runs outside it, as the loop's does."""

    def __init__(self, model: GPT, n_stages: int, stage: int) -> None:
        super().__init__()
        if not 0 <= stage < n_stages:
            raise ValueError(f"stage {stage} of {n_stages} does not exist")
        cfg = model.cfg
        self.cfg, self.vocab_size = cfg, model.vocab_size  # build_optimizer's default LR reads cfg.n_embd
        self.stage_index, self.n_stages = stage, n_stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.layers = stage_layers(cfg.n_layer, n_stages)[stage]
        self.autocast: Callable[[], ContextManager] = contextlib.nullcontext
        # One memo for every copy: the head of a tied model maps to this stage's copy of the embedding.
        memo: dict[int, Any] = {}
        # Registered in GPT's order (wte, wpe, drop, blocks, norm_f, lm_head): the merged state dicts
        # and parameter lists come out in the single-process order.
        if self.is_first or self.holds_tied_copy:
            self.wte = copy.deepcopy(model.wte, memo)
        if self.is_first:
            self.wpe = copy.deepcopy(model.wpe, memo)
            self.drop = copy.deepcopy(model.drop, memo)
        self.blocks = nn.ModuleDict({str(i): copy.deepcopy(model.blocks[i], memo) for i in self.layers})
        if self.is_last:
            self.norm_f = copy.deepcopy(model.norm_f, memo)
            self.lm_head = copy.deepcopy(model.lm_head, memo)
            if cfg.tie_weights and not self.is_first:
                setattr(self.wte.weight, COUNTED_ELSEWHERE, True)
        if model.rope_cos is not None:  # every stage's blocks rotate by position
            self.register_buffer("rope_cos", model.rope_cos.clone(), persistent=False)
            self.register_buffer("rope_sin", model.rope_sin.clone(), persistent=False)
        else:
            self.rope_cos = self.rope_sin = None

    @property
    def holds_tied_copy(self) -> bool:
        """This stage holds the tied embedding/head weight that another stage holds too."""
        return self.cfg.tie_weights and self.n_stages > 1 and (self.is_first or self.is_last)

    def forward(self, x: torch.Tensor, cache: object = None) -> torch.Tensor:
        if cache is not None:
            raise ValueError("a pipeline stage cannot generate with a KV cache: gather the whole model into one "
                             "process (PipelineModelState.state_dict() into a GPT) and generate there")
        with self.autocast():
            if self.is_first:
                x = self._embed(x)
            rope = (self.rope_cos, self.rope_sin) if self.rope_cos is not None else None
            for index, block in self.blocks.items():  # keyed by the block's index in the whole model
                x = run_block(block, x, rope, int(index), self.cfg, self.training)
            if self.is_last:
                x = self.lm_head(self.norm_f(x))
        return x

    def _embed(self, idx: torch.Tensor) -> torch.Tensor:
        """GPT._residual_stream's start, without a cache."""
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds the model's context {self.cfg.block_size}")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        return self.drop(x) if self.training else x


def mark_tied_copy(stage: StageModule) -> None:
    """Mark the last stage's copy of a tied weight COUNTED_ELSEWHERE (again after fully_shard, which
    replaces the parameters)."""
    if stage.holds_tied_copy and not stage.is_first:
        setattr(stage.wte.weight, COUNTED_ELSEWHERE, True)


def shard_stage(stage: StageModule, mesh: Any, param_dtype: torch.dtype | None = None) -> None:
    """FSDP2 over the data-parallel `mesh` (1-D: shards; 2-D: replicas x shards, HSDP), in place:
    each block its own unit, then the stage (its ends: embedding, final norm, head, a tied copy),
    as wrapping.shard_model does for the whole model; float32 gradient reduction under bf16/fp16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in stage.blocks.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(stage, mesh=mesh, mp_policy=policy)
    mark_tied_copy(stage)


def build_stage_module(model: GPT, n_stages: int, stage: int) -> StageModule:
    """Stage `stage` of `model` split into `n_stages` (see StageModule)."""
    return StageModule(model, n_stages, stage)


def build_rank_stages(model: GPT, pp: int, rank: int, schedule: str) -> list[StageModule]:
    """The stages pipeline process `rank` of `pp` holds under `schedule`, in stage order."""
    n_stages = pp * pipeline_virtual_stages(schedule)
    return [StageModule(model, n_stages, s) for s in rank_stage_indices(pp, rank, schedule)]


class RankModule(nn.Module):
    """A process's stages as one module under GPT's names (their blocks merged into one ModuleDict),
    sharing the stages' submodules: what `build_optimizer`, `parameters()`, `named_parameters()`,
    `train()` and `eval()` take. No forward of its own (the schedule runs the stages); to move
    them, move the stages (RoPE tables are theirs)."""

    def __init__(self, stages: Sequence[StageModule]) -> None:
        super().__init__()
        stages = sorted(stages, key=lambda s: s.stage_index)
        if not stages:
            raise ValueError("a pipeline process holds at least one stage")
        if len(stages) > 1 and stages[0].is_first and stages[-1].is_last:
            # its `wte` and `lm_head` would be two copies of one tied weight under two names
            raise ValueError("one process holding both the first and the last of several stages is not supported")
        self.cfg = stages[0].cfg
        # GPT's order: wte, wpe, drop, blocks, norm_f, lm_head (at most one stage here holds each end)
        self._take(stages, "wte", "wpe", "drop")
        self.blocks = nn.ModuleDict({key: block for stage in stages for key, block in stage.blocks.items()})
        self._take(stages, "norm_f", "lm_head")

    def _take(self, stages: Sequence[StageModule], *names: str) -> None:
        for name in names:
            for stage in stages:
                if stage._modules.get(name) is not None:
                    setattr(self, name, stage._modules[name])

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("a RankModule is not run; the pipeline schedule runs its stages")


# ---- gradients across stages -----------------------------------------------------------------------

def tied_weight_group(pipelines: Sequence[Sequence[int]] | None = None) -> ProcessGroup | None:
    """The 2-process group of this process's pipeline's first and last process, which hold the
    copies of a tied embedding/head (None when this process holds neither, or a pipeline is one
    process). `pipelines`: the global ranks of every pipeline, each in stage-process order
    (default: all processes form one). new_group is collective: every process calls this, alike."""
    import torch.distributed as dist

    pipelines = pipelines or [list(range(dist.get_world_size()))]
    mine = None
    for ranks in pipelines:
        if len(ranks) < 2:
            continue
        pair = [ranks[0], ranks[-1]]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


def sync_tied_gradients(stages: Sequence[StageModule], group: ProcessGroup | None) -> None:
    """Sum the gradients of a tied embedding's copies (first stage's `wte.weight`, last stage's) over
    the 2-process `group` (tied_weight_group), so both hold the single-process gradient. A no-op on
    processes holding neither and for an untied or unsplit model. Call after each window's backward."""
    copies = [stage.wte.weight for stage in stages if stage.holds_tied_copy]
    if not copies:
        return
    grads = []
    for param in copies:
        if param.grad is None:  # a stage that saw no gradient still takes part in the sum
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    # FSDP2: each copy's shard (the same rows on both ends: one data-parallel position, one mesh)
    grads = [local_tensor(g) for g in grads]
    if len(grads) == 2:  # both ends on this process
        grads[0].add_(grads[1])
        grads[1].copy_(grads[0])
        return
    if group is None:
        raise ValueError("the tied embedding and head are split across processes: pass tied_weight_group()'s group")
    import torch.distributed as dist

    dist.all_reduce(grads[0], group=group)


def clip_grad_norm(stage_params: Iterable[torch.Tensor], max_norm: float | None,
                   group: ProcessGroup | None = None, shard_group: ProcessGroup | None = None) -> torch.Tensor:
    """The global gradient norm over every stage's parameters (all-reduced squares over the pipeline
    `group`; a tied weight's second copy is not counted), and each gradient scaled by
    max_norm / norm when that is below 1 (torch's clip_grad_norm_ coefficient); `max_norm` None: the
    norm only. `shard_group`: the processes the gradients are sharded over (FSDP2; the squares of
    the shards summed over it first). Returns the pre-clip norm, the same on every process."""
    params = list({id(p): p for p in stage_params}.values())
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    counted = [local_tensor(p.grad) for p in params
               if p.grad is not None and not getattr(p, COUNTED_ELSEWHERE, False)]
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), device=device, dtype=torch.float32)
    if counted:
        squares = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in counted])).float() ** 2
    import torch.distributed as dist

    if shard_group is not None and _distributed(shard_group):  # None: not sharded (not the world)
        dist.all_reduce(squares, group=shard_group)
    if _distributed(group):
        dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    if max_norm is not None and grads:
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as clip_grad_norm_ computes it
        torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))
    return total


# ---- the loss and the schedules ---------------------------------------------------------------------

class WindowLoss:
    """The schedule's loss_fn: a micro-batch's cross-entropy summed over real targets (IGNORE_INDEX
    counts for nothing), divided by `n_tokens`, the whole window's real tokens over all processes
    (set before each window), times `scale` (the data-parallel size where the gradients are averaged
    across replicas). The gradient is then llmtrain's loop's, engine/step.py's loss_sum / n_tokens."""

    def __init__(self, label_smoothing: float = 0.0) -> None:
        self.label_smoothing = label_smoothing
        self.n_tokens = 1
        self.scale = 1.0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=self.label_smoothing)
        loss = loss / self.n_tokens
        return loss * self.scale if self.scale != 1 else loss


def build_schedule(stages: Sequence[StageModule], n_microbatches: int, kind: str,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                   group: ProcessGroup | None = None) -> Any:
    """A torch pipelining schedule over this process's `stages` (PipelineStage each; shapes inferred
    on the first step) for `n_microbatches` micro-batches of one shape. Gradients are not scaled by
    the micro-batch count (WindowLoss already divides). `kind`: gpipe, 1f1b (fewer micro-batches than
    stages, which torch's 1F1B refuses, run as GPipe: the same arithmetic, in the same order) or
    interleaved_1f1b (two stages per process). `group`: the pipeline's processes (default: all)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    _check_schedule(kind)
    stages = sorted(stages, key=lambda s: s.stage_index)
    if len(stages) != pipeline_virtual_stages(kind):
        raise ValueError(f"the {kind} schedule runs {pipeline_virtual_stages(kind)} stage(s) per process, "
                         f"not {len(stages)}")
    device = _device_of(stages[0])
    wrapped = [PipelineStage(s, s.stage_index, s.n_stages, device, group=group) for s in stages]
    if kind == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(wrapped, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    cls = Schedule1F1B if kind == "1f1b" and n_microbatches >= stages[0].n_stages else ScheduleGPipe
    return cls(wrapped[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)


def run_window(schedule: Any, stages: Sequence[StageModule], batches: Sequence[Batch], loss_fn: WindowLoss,
               n_tokens: int, *, scale: float = 1.0, group: ProcessGroup | None = None) -> torch.Tensor:
    """One optimizer step's forward and backward over `batches` (the window's micro-batches, one shape,
    as many as the schedule's), gradients accumulated into the stages' parameters. Returns the
    window's loss (sum over micro-batches of loss_sum / n_tokens, x `scale`) on every process of the
    pipeline: the last stage computes it and broadcasts it."""
    device = _device_of(stages[0])
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    loss_fn.n_tokens, loss_fn.scale = max(1, n_tokens), scale
    losses: list[torch.Tensor] = []
    x = torch.cat([b[0] for b in batches]).to(device) if first else None
    y = torch.cat([b[1] for b in batches]).to(device) if last else None
    schedule.step(*([x] if first else []), target=y, losses=losses if last else None, return_outputs=False)
    window_loss = torch.zeros((), device=device)
    for loss in losses:  # in order, as accumulate_window adds them
        window_loss += loss.detach()
    return broadcast_from_last(window_loss, group)


def broadcast_from_last(value: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """`value` as the pipeline's last process holds it, on every process of the pipeline (in place)."""
    if _distributed(group):
        import torch.distributed as dist

        g = group or dist.group.WORLD
        dist.broadcast(value, src=dist.get_global_rank(g, dist.get_world_size(g) - 1), group=group)
    return value


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _distributed(group: ProcessGroup | None) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


# ---- one process's part, for the loop ----------------------------------------------------------------

class Pipeline:
    """This process's part of a pipeline-parallel GPT: its stages (copies of `model`'s pieces), the
    schedules (one per micro-batch count and shape, built on first use), the tied-weight group, and
    what the loop calls: `forward_backward`, `clip_grad_norm`, `evaluate`, the state views.
    `group`: the pipeline's processes in stage order (default: all); `pipelines`: every pipeline's
    global ranks, needed when there are several (tied_weight_group). `data_mesh`: the data-parallel
    sub-mesh the stages are FSDP2-sharded over (1-D shards, or 2-D replicas x shards; None: no
    data parallel), `param_dtype` its compute copies' type. Every process builds it at the same
    time (collective: the tied group, the sharding), each from the same `model`."""

    def __init__(self, model: GPT, schedule: str, *, group: ProcessGroup | None = None,
                 pipelines: Sequence[Sequence[int]] | None = None, device: torch.device | None = None,
                 label_smoothing: float = 0.0, autocast: Callable[[], ContextManager] | None = None,
                 data_mesh: Any = None, param_dtype: torch.dtype | None = None) -> None:
        import torch.distributed as dist

        _check_schedule(schedule)
        self.kind, self.group = schedule, group
        self.pp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.stages = build_rank_stages(model, self.pp, rank, schedule)
        for stage in self.stages:
            if device is not None:
                stage.to(device)
            stage.autocast = autocast or contextlib.nullcontext
        # FSDP2: the shards' group (a 2-D mesh's second dimension: replicas hold the same shards), and
        # whether this process is its pipeline's copy at data-parallel position 0 (the state views
        # gather that pipeline's states on its first process: global rank 0).
        self.shard_group, self.gathers_state = None, True
        if data_mesh is not None:
            for stage in self.stages:
                shard_stage(stage, data_mesh, param_dtype)
            self.shard_group = data_mesh.get_group(data_mesh.ndim - 1)
            self.gathers_state = data_mesh.get_local_rank(0) == 0 and (
                data_mesh.ndim == 1 or data_mesh.get_local_rank(1) == 0)
        self.module = RankModule(self.stages)
        self.tied_group = None
        if model.cfg.tie_weights and self.pp > 1:
            self.tied_group = tied_weight_group(pipelines or [dist.get_process_group_ranks(group or dist.group.WORLD)])
        self.loss = WindowLoss(label_smoothing)
        self.eval_loss = WindowLoss()  # the plain summed loss: evaluation never smooths labels
        self._schedules: dict[tuple, Any] = {}

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def counted_parameters(self) -> list[nn.Parameter]:
        """This process's parameters without a tied weight's second copy: summed over the pipeline,
        every parameter of the model once (the monitor's norms)."""
        return [p for p in self.parameters() if not getattr(p, COUNTED_ELSEWHERE, False)]

    def join(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the pipeline's processes (in place; every process must call it)."""
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.group)
        return tensor

    def forward_backward(self, batches: Sequence[Batch], n_tokens: int, dp_size: int = 1) -> torch.Tensor:
        """The window's gradients (the tied copies' summed), and its loss on every process of the
        pipeline: accumulate_window's contract (n_tokens over all processes; x dp_size where the
        data-parallel replicas average their gradients)."""
        schedule = self._schedule("train", len(batches), _microbatch_shape(batches), self.loss)
        loss = run_window(schedule, self.stages, batches, self.loss, n_tokens, scale=dp_size, group=self.group)
        sync_tied_gradients(self.stages, self.tied_group)
        return loss

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        return clip_grad_norm(self.parameters(), max_norm, self.group, self.shard_group)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Batch]) -> float:
        """Mean loss per real token over fixed batches in eval mode (engine/step.py's evaluate), on
        every process of the pipeline; each batch split into up to pp equal micro-batches."""
        self.module.eval()
        first, last = self.stages[0].is_first, self.stages[-1].is_last
        total = torch.zeros((), device=_device_of(self.stages[0]), dtype=torch.float64)
        try:
            for x, y in batches:
                n = max(d for d in range(1, min(self.pp, len(x)) + 1) if len(x) % d == 0)
                shape = (len(x) // n, *x.shape[1:])
                schedule = self._schedule("eval", n, shape, self.eval_loss)
                losses: list[torch.Tensor] = []
                device = total.device
                schedule.eval(*([x.to(device)] if first else []), target=y.to(device) if last else None,
                              losses=losses if last else None, return_outputs=False)
                for loss in losses:
                    total += loss.double()
        finally:
            self.module.train()
        count = sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)
        return broadcast_from_last(total, self.group).item() / max(1, count)

    def model_state(self) -> PipelineModelState:
        from llmtrain.distributed.pipeline_state import PipelineModelState

        return PipelineModelState(self.stages, self.group, gathers=self.gathers_state)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> PipelineOptimizerState:
        from llmtrain.distributed.pipeline_state import PipelineOptimizerState

        return PipelineOptimizerState(self.stages, optimizer, self.group, gathers=self.gathers_state)

    def _schedule(self, purpose: str, n_microbatches: int, shape: tuple, loss_fn: WindowLoss) -> Any:
        """The schedule for this many micro-batches of this shape (torch infers the shapes it sends
        once, on a schedule's first step)."""
        key = (purpose, n_microbatches, tuple(shape))
        if key not in self._schedules:
            if len(self._schedules) >= _SCHEDULES_KEPT:
                del self._schedules[next(iter(self._schedules))]  # the oldest
            self._schedules[key] = build_schedule(self.stages, n_microbatches, self.kind, loss_fn, group=self.group)
        return self._schedules[key]


def _microbatch_shape(batches: Sequence[Batch]) -> tuple:
    shapes = {tuple(x.shape) for x, _ in batches}
    if len(shapes) != 1:
        raise ValueError(f"a pipeline step's micro-batches have one shape; got {sorted(shapes)}")
    return shapes.pop()
