"""Catalog of the health alarms the training monitor can raise: what each watches, its likely causes, what to check.

The healthy bands and alarm signals come from the seed's monitoring table (section 8.2: gradient norm 0.1 to 10,
alarm when persistently > 100 or < 0.001; parameter norm grows slowly, alarm on a sudden jump or a steady decrease;
learning rate follows the schedule, alarm when unexpectedly zero or exploding; activation mean near 0, alarm on a
persistent drift; activation variance near 1, alarm when persistently growing or shrinking; memory stable, alarm on
steady growth, i.e. a leak). The causes and checks come from the seed's debugging tables (5.1 recurrence view:
learning rate, gradient clipping, data order, loss function, initialization; 5.2 recursion view: residual
connections, layer norm, activation checkpointing, memory, depth; 5.3 sandwich view: train/eval mode, optimizer state,
gradient accumulation, mixed-precision scale factor), the anecdotes around them (2.4, 5.1, 5.2, 7.2, 7.4) and the
obvious additions an experienced engineer would list. Loss spikes, NaN/Inf and fp16 without a scaler are alarms
too (SPEC 8.2). Each check names the llmtrain override that acts on it where one exists.

This module is data only: the monitor decides when an alarm fires and prints `explain(name)` the first time it does.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AlarmKind", "CATALOG", "explain", "explain_ranked"]


@dataclass(frozen=True)
class AlarmKind:
    name: str  # identifier, e.g. "grad_norm_high"
    metric: str  # the metric it watches, e.g. "grad_norm"
    title: str  # one short line
    healthy: str  # the 8.2 healthy band in words
    causes: tuple[str, ...]  # likely causes, most likely first
    checks: tuple[str, ...]  # what to check / do, naming an llmtrain override where one exists
    seed_ref: str  # sections of the seed document the entry draws on, e.g. "8.2; 5.1"


_KINDS = (
    AlarmKind(
        name="grad_norm_high",
        metric="grad_norm",
        title="Gradient norm persistently above its band (alarm above 100)",
        healthy="0.1 to 10",
        causes=(
            "Learning rate too high: each step overshoots and the next gradient is larger still",
            "Warmup missing or too short: the first large steps push the weights into an extreme region",
            "Gradient clipping off or its threshold too high to bite",
            "Initialization variance too large",
        ),
        checks=(
            "Lower the peak LR, e.g. optim.lr=3e-4 (a sudden rise in grad norm calls for a lower LR)",
            "Warm up: schedule.warmup_fraction=0.05 or schedule.warmup_steps=200",
            "Clip: optim.clip_grad_norm=1.0 (usual range 1.0 to 5.0)",
            "Standard init: model.init_std=0.02 model.residual_init=scaled",
            "If it starts right after warmup ends, the LR peak is the trigger: lower optim.lr or warm up longer",
        ),
        seed_ref="8.2; 5.1; 2.4; 6.3; 7.4",
    ),
    AlarmKind(
        name="grad_norm_low",
        metric="grad_norm",
        title="Gradient norm persistently below its band (alarm below 0.001)",
        healthy="0.1 to 10",
        causes=(
            "Vanishing gradients: residual connections missing or broken, so the gradient shrinks layer by layer",
            "Learning rate too low or the schedule at zero: training has stalled",
            "Zero-initialized LM head: no gradient reaches the layers below it until the head grows",
            "Dead or saturated activations",
            "Loss scaled down too far (e.g. divided by the accumulation steps twice) or detached from the graph",
        ),
        checks=(
            "Check that each block's output contains its input (residual path); model.residual_init=scaled",
            "Compare the applied LR with the schedule; keep a floor with schedule.min_lr_ratio=0.1; raise optim.lr",
            "Untied head: model.head_init=plain (or tiny) instead of zero",
            "Look at per-layer grad norms: if only the first blocks are tiny, see grad_norm_low_early_layers",
            "Test the loss on a known input and check the effective batch size matches the accumulation setting",
        ),
        seed_ref="8.2; 5.1; 5.2; 2.3",
    ),
    AlarmKind(
        name="grad_norm_low_early_layers",
        metric="grad_norm_per_layer",
        title="Some blocks frozen: gradients orders of magnitude smaller than the largest block's",
        healthy="per-block gradient norms of similar size (no two-orders-of-magnitude gap)",
        causes=(
            "Residual-branch projections initialized with too small a variance, so the gradient does not get back",
            "Residual connection missing or implemented wrongly in some block",
            "Post-LN: the gradient must pass through every LayerNorm and is rescaled at each one",
            "Model too deep for the optimizer to coordinate all layers",
        ),
        checks=(
            "Standard init for the residual projections: model.residual_init=scaled model.init_std=0.02",
            "Pre-LN lets the gradient flow straight through the residual path: model.norm_position=pre",
            "Check that each block's output contains its input",
            "Fewer layers (e.g. model.n_layer=4) to see whether it improves",
            "Rule out checkpointing: compare gradients with model.activation_checkpointing=none",
        ),
        seed_ref="5.2; 7.2; 3.4; 2.3",
    ),
    AlarmKind(
        name="param_norm_jump",
        metric="param_norm",
        title="Parameter norm jumped suddenly",
        healthy="grows slowly",
        causes=(
            "An LR spike, or an LR too high for the model",
            "A bad data batch produced one huge update",
            "Instability building up before divergence (NaN often follows)",
            "Optimizer state not initialized or loaded correctly, e.g. after a resume",
        ),
        checks=(
            "Lower the LR (optim.lr=...) and keep clipping on: optim.clip_grad_norm=1.0",
            "Inspect the batch at that step; make sure the data is shuffled, not sorted",
            "After a resume: print the optimizer state and look for NaN, or retry with resume=never",
            "Recover automatically: checkpoint.on_nonfinite=rollback checkpoint.rollback_lr_factor=0.5",
        ),
        seed_ref="8.2; 5.1; 5.3; 2.4",
    ),
    AlarmKind(
        name="param_norm_decrease",
        metric="param_norm",
        title="Parameter norm decreasing steadily",
        healthy="grows slowly",
        causes=(
            "Weight decay too strong relative to the gradient updates",
            "Learning rate too low: the updates are too small to balance the decay",
            "Gradients carry almost no signal, so only the decay acts (see grad_norm_low)",
            "Initialization larger than the weights settle at (often harmless early in the run)",
        ),
        checks=(
            "Lower the decay: optim.weight_decay=0.01 (default 0.1)",
            "Raise the LR: optim.lr=... ; check the schedule floor schedule.min_lr_ratio=0.1",
            "Stop decaying the embeddings: optim.decay_embeddings=false",
            "Check the gradient norm and the init scale (model.init_std=0.02)",
        ),
        seed_ref="8.2; 5.1",
    ),
    AlarmKind(
        name="lr_zero",
        metric="lr",
        title="Learning rate is zero while the schedule says otherwise (or reached zero mid-run)",
        healthy="follows the schedule",
        causes=(
            "Schedule decays to zero (min_lr_ratio=0) and its length is shorter than the run",
            "Scheduler stepped per micro-batch instead of per optimizer step, so it ran out early",
            "Run length changed on resume (max_steps, max_tokens, global_batch_size), so total steps disagree",
            "LR overwritten: restored from a checkpoint, or shrunk by repeated rollbacks",
        ),
        checks=(
            "Keep a floor: schedule.min_lr_ratio=0.1",
            "Compare the logged LR with the schedule printed at start; resume with the same max_steps/max_tokens",
            "Limit LR shrinking on rollback: checkpoint.rollback_lr_factor=1.0 or checkpoint.max_rollbacks=...",
            "Set the peak explicitly: optim.lr=3e-4",
        ),
        seed_ref="8.2; 5.1; 7.4",
    ),
    AlarmKind(
        name="lr_exploding",
        metric="lr",
        title="Learning rate far above the schedule, or growing",
        healthy="follows the schedule",
        causes=(
            "LR overwritten from a restored optimizer state or by a callback that keeps multiplying it",
            "Batch-size LR scaling applied twice, or with a much larger batch than intended",
            "Scheduler driven by the wrong step count",
            "Abrupt schedule change (step decay, restart) instead of a smooth curve",
        ),
        checks=(
            "Set the peak explicitly: optim.lr=3e-4; compare the logged LR with the schedule printed at start",
            "Rule out restored state: resume=never",
            "Check the effective batch printed at start (global_batch_size, micro_batch_size)",
            "Use a smooth schedule (schedule=cosine) and keep clipping on: optim.clip_grad_norm=1.0",
        ),
        seed_ref="8.2; 7.4; 5.3",
    ),
    AlarmKind(
        name="activation_mean_drift",
        metric="activation_mean",
        title="Block-output mean drifting away from 0",
        healthy="near 0",
        causes=(
            "Normalization missing, misplaced, or over the wrong dimension",
            "Bias terms drifting",
            "Initialization mean or variance wrong",
            "Residual stream accumulating an offset across blocks",
        ),
        checks=(
            "Compare the norm layers with a standard implementation; they should normalize over n_embd",
            "Norm placement: model.norm_position=pre",
            "Rule out bias drift: model.bias=false",
            "Check each layer's output mean and variance at init: model.init_std=0.02",
        ),
        seed_ref="8.2; 5.1; 5.2; 2.3",
    ),
    AlarmKind(
        name="activation_variance_growing",
        metric="activation_var",
        title="Activation variance trending up",
        healthy="near 1",
        causes=(
            "Residual branches adding up without being scaled down",
            "Norm placement: with pre-LN the residual stream itself is never normalized; post-LN misconfigured",
            "Initialization too large",
            "Learning rate too high: weights grow fast",
        ),
        checks=(
            "Scale the residual projections: model.residual_init=scaled",
            "Check the norm layers and their position: model.norm_position=pre",
            "Standard init: model.init_std=0.02",
            "Lower optim.lr=... and keep weight decay on: optim.weight_decay=0.1",
        ),
        seed_ref="8.2; 5.1; 5.2; 7.2; 2.3",
    ),
    AlarmKind(
        name="activation_variance_high",
        metric="activation_var",
        title="Block-output variance far above its healthy level",
        healthy="near 1 for a normalized signal; tens in a healthy pre-LN residual stream",
        causes=(
            "Learning rate too high, or no warmup: the weights grew fast and the residual stream with them",
            "Initialization too large",
            "Residual branches adding up without being scaled down",
        ),
        checks=(
            "Lower optim.lr=... and warm up: schedule.warmup_fraction=0.05",
            "Standard init: model.init_std=0.02 model.residual_init=scaled",
            "Check the norm layers and their position: model.norm_position=pre",
        ),
        seed_ref="8.2; 5.1; 5.2",
    ),
    AlarmKind(
        name="activation_variance_shrinking",
        metric="activation_var",
        title="Activation variance trending down",
        healthy="near 1",
        causes=(
            "Norm layers wrong: bad placement, wrong dimension or parameters",
            "Dying activations: more and more units stuck at zero",
            "Over-regularization: weight decay or dropout too strong",
            "Initialization variance too small",
        ),
        checks=(
            "Check the norm layers first against a standard implementation (model.norm=layernorm or rmsnorm)",
            "Less regularization: optim.weight_decay=0.01 model.dropout=0.0",
            "Standard init: model.init_std=0.02 model.residual_init=scaled",
            "Check each layer's output mean and variance to find where it starts",
        ),
        seed_ref="8.2; 5.2; 5.1",
    ),
    AlarmKind(
        name="memory_leak",
        metric="memory",
        title="Memory rising steadily after warm-up",
        healthy="stable",
        causes=(
            "Tensors kept across steps: summing loss tensors (total += loss) keeps each step's graph alive",
            "Logging tensors instead of Python floats",
            "Lists or caches that grow every step (metric history, saved activations, hooks added per step)",
            "Allocator cache growing with varying shapes (reserved memory rises, allocated does not)",
        ),
        checks=(
            "Accumulate and log plain floats: loss.item(), float(x)",
            "Compare allocated with reserved memory: only allocated growth is a real leak",
            "Analyse the memory distribution with a profiler (torch.cuda.memory_summary or a memory snapshot)",
            "Look for containers and hooks that grow per step",
        ),
        seed_ref="8.2; 5.2",
    ),
    AlarmKind(
        name="loss_spike",
        metric="loss",
        title="Loss far above its recent window (robust z-score)",
        healthy="smooth, within a few robust standard deviations of the recent window",
        causes=(
            "A bad data batch, or data not shuffled (e.g. sorted by length)",
            "Learning rate too high, often right after warmup ends",
            "fp16 overflow (loss scale too high)",
            "Batch too small: noisy gradients",
            "Abrupt LR change from the schedule",
        ),
        checks=(
            "Check that the data is shuffled and inspect the batch at that step",
            "Lower the LR and warm up: optim.lr=... schedule.warmup_fraction=0.05; clip: optim.clip_grad_norm=1.0",
            "Switch to precision=bf16, or watch the fp16 loss scale logged by precision=fp16",
            "Larger effective batch via accumulation: global_batch_size=... (a multiple of micro_batch_size)",
            "Use a smooth schedule: schedule=cosine",
        ),
        seed_ref="8.3; 5.1; 2.4; 7.4; 6.1",
    ),
    AlarmKind(
        name="grad_norm_surge",
        metric="grad_norm",
        title="Gradient norm rose suddenly, far above its recent median",
        healthy="changes gradually; 0.1 to 10",
        causes=(
            "Learning rate too high for this point of training (often as warmup ends)",
            "Warmup missing or too short",
            "Gradient clipping off",
            "A bad batch",
        ),
        checks=(
            "A sudden rise in the gradient norm calls for a lower LR: optim.lr=... (the default action halves it)",
            "Warm up: schedule.warmup_fraction=0.05",
            "Clip: optim.clip_grad_norm=1.0",
            "Inspect the batch at that step",
        ),
        seed_ref="8.2; 5.1; 2.4",
    ),
    AlarmKind(
        name="update_ratio_high",
        metric="update_ratio",
        title="Each step changes the weights by a large fraction of their size",
        healthy="||dW|| / ||W|| around 1e-3 per step (1e-2 early in training)",
        causes=(
            "Learning rate too high",
            "Warmup missing: the full LR on the first, unreliable gradients",
            "Initialization too small: tiny weights make every update large relative to them",
            "Weight decay too strong: the decay itself is a large update",
        ),
        checks=(
            "Lower the LR: optim.lr=... (optim.lr=null gives the default for the optimizer and width)",
            "Warm up: schedule.warmup_fraction=0.05",
            "Standard init: model.init_std=0.02",
            "optim.weight_decay=0.1",
        ),
        seed_ref="5.1; 8.2",
    ),
    AlarmKind(
        name="update_ratio_low",
        metric="update_ratio",
        title="Steps barely change the weights",
        healthy="||dW|| / ||W|| around 1e-3 per step",
        causes=(
            "Learning rate too low",
            "The LR schedule at its floor or at zero",
            "Gradients carry almost no signal",
        ),
        checks=(
            "Raise the LR: optim.lr=null gives the default for the optimizer and width",
            "Compare the logged LR with the schedule; schedule.min_lr_ratio=0.1",
            "Look at the gradient norms per block",
        ),
        seed_ref="5.1; 8.2",
    ),
    AlarmKind(
        name="steps_too_small",
        metric="update_ratio",
        title="Learning slowly: the gradient stays the same step after step, and each step barely moves along it",
        healthy="a gradient that is mostly noise from one step to the next (Adam's first moment^2 / second moment "
                "~0.05-0.3), steps of ~1e-3 of the weights",
        causes=(
            "Learning rate too low",
            "Adam epsilon so large that it, not the gradient's size, sets every step",
            "The LR schedule at its floor or at zero",
        ),
        checks=(
            "Raise the LR: optim.lr=null gives the default for the optimizer and width",
            "optim.eps=1e-8",
            "Compare the logged LR with the schedule; schedule.min_lr_ratio=0.1",
        ),
        seed_ref="5.1; 8.2",
    ),
    AlarmKind(
        name="loss_above_chance",
        metric="loss",
        title="Loss far above a uniform guess over the vocabulary",
        healthy="at most ln(vocabulary) at the start, falling from there",
        causes=(
            "Initialization too large: the logits start huge and confidently wrong",
            "Learning rate far too high: the first updates blew the model up",
            "fp16 overflow, or a loss computed on the wrong targets",
        ),
        checks=(
            "Standard init: model.init_std=0.02",
            "Lower the LR and warm up: optim.lr=null schedule.warmup_fraction=0.05",
            "Test the loss on a known input: a fresh model's loss should be close to ln(vocabulary)",
        ),
        seed_ref="5.1; 2.4",
    ),
    AlarmKind(
        name="loss_rising",
        metric="loss",
        title="Loss climbing well above its best, check after check (divergence, not a spike)",
        healthy="falling, or flat late in training",
        causes=(
            "Learning rate too high: the run is diverging",
            "Warmup missing or too short",
            "Gradient clipping off",
            "Data not shuffled: the loss follows the order of the files",
        ),
        checks=(
            "Lower the LR: optim.lr=...; warm up: schedule.warmup_fraction=0.05",
            "Clip: optim.clip_grad_norm=1.0",
            "Shuffle: data.shuffle=true",
            "Recover automatically: monitor.actions.loss_rising=rollback",
        ),
        seed_ref="5.1; 8.3; 2.4",
    ),
    AlarmKind(
        name="loss_not_decreasing",
        metric="loss",
        title="The model is not learning: the loss has not left chance, or is stuck at the unigram baseline",
        healthy="well below the unigram baseline (the loss of a model that ignores context) after the first steps",
        causes=(
            "Learning rate too low, or the schedule at its floor",
            "Initialization too small or too large",
            "Learning rate so high that the model cannot settle",
            "Post-LN or a deep stack that passes no gradient to its first blocks",
        ),
        checks=(
            "optim.lr=null (the default for the optimizer and width)",
            "Standard init: model.init_std=0.02 model.residual_init=scaled",
            "model.norm_position=pre",
            "Overfit one batch first: llmtrain doctor",
        ),
        seed_ref="5.1; 8.3",
    ),
    AlarmKind(
        name="loss_oscillating",
        metric="loss",
        title="Loss swinging between checks far more than the noise of its steps explains (correlated batches)",
        healthy="interval means that vary by about their steps' noise / the number of steps",
        causes=(
            "Data not shuffled: consecutive batches come from the same part of the corpus",
            "A data order that groups similar documents (sorted by source, length or topic)",
        ),
        checks=(
            "Shuffle: data.shuffle=true, or data.sampling=epoch (a new order every epoch)",
            "Inspect the order of the prepared windows",
        ),
        seed_ref="5.1; 8.3",
    ),
    AlarmKind(
        name="loss_autocorrelated",
        metric="loss",
        title="Consecutive steps' losses move together: batches read in file order follow the text",
        healthy="steps that are independent draws: their losses' successive differences as large as independent ones'",
        causes=(
            "Data not shuffled: each batch is the stretch of the corpus after the last one, so the gradient "
            "follows the text (one file's style, then the next) instead of the whole corpus",
        ),
        checks=(
            "Shuffle: data.shuffle=true, or data.sampling=epoch (a new order every epoch)",
        ),
        seed_ref="5.1; 8.3",
    ),
    AlarmKind(
        name="overfitting",
        metric="val_loss",
        title="Validation stalls while the train loss keeps falling: the gap between them widens (overfitting)",
        healthy="validation falling about as much as training",
        causes=(
            "Too little data for the model and the number of steps: it memorizes the training set",
            "Too many passes over the same data",
            "Too little regularization for this data size (dropout, weight decay)",
        ),
        checks=(
            "Stop at the best validation step: checkpoint.keep_best=true keeps its checkpoint",
            "More data (data.path), or fewer steps (max_steps)",
            "Regularize: model.dropout=0.1, optim.weight_decay=0.1; or a smaller model",
        ),
        seed_ref="8.1; 8.3",
    ),
    AlarmKind(
        name="weight_decay_dominant",
        metric="update_ratio",
        title="Weight decay makes most of each update: the weights follow the decay, not the gradient",
        healthy="lr x weight decay a few percent of the update/weight ratio",
        causes=(
            "Weight decay far too strong (AdamW's is decoupled: it shrinks the weights by lr x weight_decay per step)",
            "Learning rate too low for the gradient step to matter beside the decay",
        ),
        checks=(
            "optim.weight_decay=0.1 (usual 0.01-0.1)",
            "Check the LR against the sane range: llmtrain check",
        ),
        seed_ref="5.1; 8.2",
    ),
    AlarmKind(
        name="schedule_ended",
        metric="lr",
        title="The LR schedule ended before the run: the rest trains at the floor LR",
        healthy="a schedule as long as the run",
        causes=("schedule.total_steps shorter than the run (often after extending max_steps)",),
        checks=("schedule.total_steps=null (the run's length), or end the run with the schedule",),
        seed_ref="8.2; 7.4",
    ),
    AlarmKind(
        name="nonfinite",
        metric="loss",
        title="NaN or Inf in the loss or gradients",
        healthy="finite",
        causes=(
            "Learning rate too high or warmup missing: the updates diverge",
            "fp16 without loss scaling, or an overflow",
            "Division by zero or log(0) in the loss (e.g. a batch with no real tokens after masking)",
            "Bad data: invalid token ids or corrupt samples",
            "Optimizer state holding NaN after a bad initialization or load",
        ),
        checks=(
            "Lower the LR and warm up: optim.lr=3e-4 schedule.warmup_steps=200",
            "Use precision=bf16, or precision=fp16 (which uses a dynamic GradScaler)",
            "Test the loss function on known inputs",
            "Print the optimizer state and look for NaN; retry with resume=never",
            "Recover automatically: checkpoint.on_nonfinite=rollback checkpoint.rollback_lr_factor=0.5",
        ),
        seed_ref="2.4; 5.1; 5.3; 6.4",
    ),
    AlarmKind(
        name="fp16_no_scaler",
        metric="loss_scale",
        title="fp16 training without a dynamic loss scaler",
        healthy="fp16 with a dynamic loss scale that adapts (drops on overflow, grows back)",
        causes=(
            "fp16's small dynamic range: small gradients underflow to zero without loss scaling",
            "Backward called on the raw loss instead of the scaled loss",
            "Scale never updated, so it cannot adapt",
        ),
        checks=(
            "Use precision=fp16, which builds a dynamic GradScaler and logs its scale, or precision=bf16 (no scaling)",
            "Tune the scaler: precision.init_scale=65536 precision.growth_interval=2000",
            "Watch the logged scale: it should fall on overflow and grow back, not sit still or collapse",
        ),
        seed_ref="8.1; 5.3; 6.4; 4.5",
    ),
)

CATALOG: dict[str, AlarmKind] = {k.name: k for k in _KINDS}
CLEAR_EVIDENCE = 0.85  # a top cause scoring this high is the configuration itself (e.g. post-LN, init std 1.0)


def explain(name: str) -> str:
    """One alarm as compact multi-line text: title, healthy band, likely causes and what to check."""
    try:
        kind = CATALOG[name]
    except KeyError:
        raise KeyError(f"Unknown alarm '{name}'; known: {', '.join(CATALOG)}") from None
    lines = [f"{kind.title} [{kind.name}: {kind.metric}, healthy: {kind.healthy}]", "  Likely causes:"]
    lines += [f"    - {cause}" for cause in kind.causes]
    lines.append("  Check:")
    lines += [f"    - {check}" for check in kind.checks]
    return "\n".join(lines)


def explain_ranked(name: str, causes: list, action: str = "warn", severity: str = "warning") -> str:
    """An alarm with its causes ranked for this run: the title, then each cause with the evidence
    that ranked it and its fix, most likely first (`monitor/diagnosis.py`). When the evidence is
    clear, the alarm critical and its action only a warning, how to make such runs stop by themselves."""
    kind = CATALOG[name]
    lines = [f"{kind.title} [{kind.name}: {kind.metric}, healthy: {kind.healthy}]",
             "  Most likely causes, for this run:"]
    # The likely ones: a cause the evidence barely supports is in the record, not in the text.
    shown = [cause for cause in causes if cause.score >= 0.2][:4] or causes[:1]
    for i, cause in enumerate(shown, 1):
        fix = f" -> {cause.fix}" if cause.fix else ""
        lines.append(f"    {i}. {cause.title} ({cause.evidence}){fix}")
    if causes[0].score >= CLEAR_EVIDENCE and action == "warn" and severity == "critical":
        lines.append(f"  The evidence is clear: fix it and start again; to stop such a run at this alarm: "
                     f"'++monitor.actions.{name}=stop'")
    return "\n".join(lines)
