"""What a training step's activations cost per token: the bytes autograd saves for backward in each
block, at the head and in the loss (`activation_bytes_per_token`), and what activation checkpointing
keeps of them and adds back while it recomputes (`checkpointed_activations`). preflight/estimate.py
builds a device's memory from these.

Counted per token from what each op saves for backward (validated against autograd's own
saved-tensor hooks in the tests): per block the norm inputs and outputs, q/k/v and the attention
output, the MLP's hidden pre- and post-activation, dropout masks, and the full (T x T) attention
weights when the attention falls back to its math kernel (dropout on CPU). With activation
checkpointing a checkpointed block keeps only its input (full) or its input and its matmul and
attention outputs (op).
"""

from __future__ import annotations

from llmtrain.checkpointing import CheckpointPlan
from llmtrain.config.derived import seq_len_of
from llmtrain.config.schema import (
    ActivationCheckpointing,
    Config,
    MlpKind,
    NormKind,
    NormPosition,
    PositionEncoding,
    Precision,
)
from llmtrain.model import mlp_width


def activation_bytes_per_token(cfg: Config, precision: Precision, device_type: str) -> dict[str, float]:
    """Bytes autograd saves per token: one block (`block`), the part of it inside attention and the
    MLP that tensor parallelism splits (`block_split`: everything but the norms and the residual
    stream's dropout masks), a checkpointed block's input (`block_input`), what a block checkpointed
    with model.activation_checkpointing=op keeps besides its input (`block_op`, and `block_op_split`
    its part tensor parallelism splits), and the embedding + head (`head`, `head_transient`)."""
    m = cfg.model
    C, T, H = m.n_embd, seq_len_of(cfg), m.n_head
    low = precision in (Precision.bf16, Precision.fp16)
    a = 2 if low else 4  # matmul outputs (and the casts of norm outputs) under autocast
    r = 4  # the residual stream stays fp32
    hidden = mlp_width(m)
    has_dropout = m.dropout > 0
    norm_stats = 4 if m.norm is NormKind.rmsnorm else 8  # rstd (+ mean for LayerNorm), fp32, per token

    # q, k, v (one storage) and the output (laid out (B, T, H, D), so the projection's input is a view
    # of it), plus the log-sum-exp per head.
    attention = 4 * C * a + 4 * H
    if m.position is PositionEncoding.rope:
        # rotate-half makes new q and k in fp32 (the fp32 cos/sin tables promote them), and SDPA
        # keeps contiguous (and, under autocast, low-precision) copies of them: measured 16 bytes
        # per channel in fp32, 14 under autocast.
        attention += 14 * C if low else 16 * C
    if has_dropout and device_type == "cpu":
        # SDPA's fused CPU kernel has no dropout, so the math kernel runs (in fp32): it keeps the
        # softmax weights, the dropout mask and the dropped weights, (T x T) per head, instead of
        # the log-sum-exp, and its own copies of q/k/v (measured net: +3 channels under autocast,
        # -2 fp32 channels in fp32, where the residual dropout masks are views it shares).
        # A sliding window (model.sliding_window) does not shrink this: the math path materializes
        # every (T x T) score, softmax weight and dropout-mask entry per head and zeroes the ones
        # outside the window (a mask masks, it does not skip), so T, not min(T, window), counts here.
        # The fused kernels keep the log-sum-exp per query either way; the band mask itself is one
        # (T x T) bool tensor, shared by every layer and sequence. Measured with autograd's saved
        # tensors (4x128, T 64, window 16): the same bytes per token with and without a window, on
        # both kernels.
        attention += 12 * H * T - 4 * H + (3 * C * a if low else -2 * C * 4)
    mlp = (4 if m.mlp is MlpKind.swiglu else 2) * a * hidden  # MLP pre/post activation (gated: 4 tensors)
    block = (
        2 * (r * C + norm_stats)  # both norms keep their input
        + 2 * a * C  # ... and their output (cast) feeds a matmul, which keeps it
        + attention
        + mlp
        + (2 * C * a if has_dropout else 0)  # residual dropout masks (same dtype as the branch output)
    )
    V = cfg.model.vocab_size or 256
    # final norm in/out, log-softmax output, targets; the embedding dropout mask (fp32 stream)
    head = a * C + 4 * V + 8 + (4 * C if has_dropout else 0) + (4 * C if m.position is PositionEncoding.rope else 0)
    if m.norm_position is not NormPosition.post:  # post-LN blocks end normalized: no final norm
        head += r * C + norm_stats
    # Backward of the loss: the gradient of the log-softmax input and of the logits (plus, under
    # autocast, the low-precision one): measured 3x the logits' fp32 size with the saved output.
    head_transient = 4 * V * 2 + (a * V if low else 0)
    # Selective (op) checkpointing keeps, besides the block's input, the outputs of the ops in
    # llmtrain/checkpointing.py's SAVED_OPS and nothing else: the fused q/k/v projection (narrower
    # with fewer key/value heads), the attention kernel's output and log-sum-exp (the math kernel:
    # its two batched matmuls, the (T x T) scores per head and the output), the output projection,
    # the MLP's up (and gate) projections and its down projection.
    kv_width = C * (m.n_kv_head or H) // H
    if has_dropout and device_type == "cpu":
        op_attention = 4 * H * T + 4 * C  # the math kernel's score and output matmuls, fp32 under autocast too
    else:
        op_attention = a * C + 4 * H
    op_split = (C + 2 * kv_width) * a + op_attention + (2 if m.mlp is MlpKind.swiglu else 1) * a * hidden
    # Tensor parallelism (Megatron-style, without sequence parallelism) splits the heads and the MLP's
    # hidden units: q/k/v, the attention output, its kernel's state and the MLP activations. The
    # norms and the residual stream (and its dropout masks) stay whole on every rank, and so do the
    # outputs of the two row-parallel projections (partial sums, before their all-reduce).
    return {"block": block, "block_split": attention + mlp, "block_input": r * C, "head": head,
            "head_transient": head_transient, "block_op": op_split + 2 * a * C, "block_op_split": op_split}


def checkpoint_plan(cfg: Config, checkpointing: CheckpointPlan | bool | None = None) -> CheckpointPlan:
    """The activation checkpointing an estimate assumes: the config's (None), a plan's rung (True:
    full on every block, False: none), or `checkpointing` itself."""
    if checkpointing is None:
        return CheckpointPlan.of(cfg.model)
    if isinstance(checkpointing, bool):
        return CheckpointPlan(ActivationCheckpointing.full if checkpointing else ActivationCheckpointing.none)
    return checkpointing


# What recomputing in backward adds to the peak. Live tensors alone add about one block: the one
# recomputed, its activations' gradients, the kernels' temporaries. On CUDA (not measured here) the
# caching allocator reuses the previous recompute's blocks: three blocks' worth of what a block
# recomputes, the rule this estimate always had. On CPU glibc's heap reuses little of it (the
# parameters' gradients, created during backward, sit between the freed recomputes): resident memory
# grows by about RECOMPUTE_HEAP_CPU of the bytes recomputed over all checkpointed blocks. Measured
# (two-step runs, resident peak; 6x128 and 12x64 at T 512, none, full and op, every block and every
# other one): 0.5-1.06, most near 0.8.
RECOMPUTE_HEAP_CPU = 0.75
RECOMPUTE_BLOCKS = 3.0


def checkpointed_activations(
    plan: CheckpointPlan, layers: int, block_act: float, block_input: float, per_token: dict[str, float],
    tp: int, pp: int, device_type: str,
) -> tuple[float, float]:
    """(bytes per token a micro-batch keeps from its forward to its backward, the extra bytes per
    token while backward recomputes, on `device_type`) for a stage of `layers` blocks, each keeping
    `block_act` (`block_input` for its input) without checkpointing, under `tp`-way tensor and
    `pp`-way pipeline parallelism.

    The checkpointed blocks keep their input (op: and the matmul and attention outputs), the others
    everything. A pipeline stage other than the first may start anywhere in the every-k pattern:
    counted with the fewest checkpointed blocks a stage of that length has."""
    if not plan.enabled:
        return layers * block_act, 0.0
    checkpointed = plan.count(layers) if pp == 1 else layers // plan.every
    keeps = block_input
    if plan.mode is ActivationCheckpointing.op:
        keeps += per_token["block_op"] - per_token["block_op_split"] * (1 - 1 / tp)
    kept = checkpointed * keeps + (layers - checkpointed) * block_act
    if checkpointed == 0:
        return kept, 0.0
    recomputed = max(0.0, block_act - (keeps - block_input))  # full: the whole block; op: all but its kept outputs
    if device_type == "cpu":
        return kept, RECOMPUTE_HEAP_CPU * checkpointed * recomputed
    return kept, RECOMPUTE_BLOCKS * recomputed
