"""Activation checkpointing: which blocks are recomputed in backward, and how much of each one is kept
(`model.activation_checkpointing`, `model.checkpoint_every`). GPT and a pipeline stage both run their
blocks through `run_block`, so the rule lives here only.

- none: every block keeps what autograd saves.
- full: a checkpointed block keeps only its input; backward runs its forward again, whole.
- op: torch's selective checkpointing. A checkpointed block keeps the outputs of the expensive ops
  (`SAVED_OPS`: the matmuls and the attention kernels) and recomputes the rest: norms, activations,
  RoPE, dropout masks, residual adds, which cost memory per element but little compute.

`model.checkpoint_every=k` checkpoints the blocks whose index (from 0, over the whole model, also
inside a pipeline stage) is a multiple of k: blocks 0, k, 2k, ... (ceil(n_layer / k) of them). The
others keep everything, as with none.

Both modes recompute with `use_reentrant=False`, which saves the RNG state before the forward and
restores it before the recompute: dropout draws the same masks, and gradients equal none's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from llmtrain.config.schema import ActivationCheckpointing, ModelConfig


def _aten_ops(*names: str) -> frozenset[torch._ops.OpOverload]:
    """The default overloads of the aten ops this torch has (the attention kernels differ by version)."""
    ops = (getattr(torch.ops.aten, name, None) for name in names)
    return frozenset(op.default for op in ops if op is not None and hasattr(op, "default"))


# What op mode keeps: the outputs of the ops whose recompute would cost as much as the forward did.
# Linear layers reach the dispatcher as mm (no bias) or addmm (bias); 3-D inputs as bmm, and the
# math attention (SDPA with dropout on CPU) as two bmm. The fused attention kernels return their
# output and log-sum-exp, which their backward needs. linear/matmul never reach the dispatcher
# (they decompose above it); listed so a torch where they do still saves them.
SAVED_OPS = _aten_ops(
    "mm", "addmm", "bmm", "baddbmm", "linear", "matmul",
    "_scaled_dot_product_flash_attention_for_cpu",  # CPU's fused kernel
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
)


def _op_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """MUST_SAVE the expensive ops, recompute the rest (MUST_SAVE, not PREFER: torch.compile would
    otherwise be free to recompute them too)."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_OP_CONTEXTS = functools.partial(create_selective_checkpoint_contexts, _op_policy)


@dataclass(frozen=True)
class CheckpointPlan:
    """A model's activation checkpointing: the mode and every k-th block (`ModelConfig` as one value,
    for the memory estimate and its callers)."""

    mode: ActivationCheckpointing = ActivationCheckpointing.none
    every: int = 1

    @classmethod
    def of(cls, model: ModelConfig) -> CheckpointPlan:
        return cls(ActivationCheckpointing(model.activation_checkpointing), model.checkpoint_every)

    @property
    def enabled(self) -> bool:
        return self.mode is not ActivationCheckpointing.none

    def checkpoints(self, index: int) -> bool:
        """Whether block `index` (from 0, over the whole model) is checkpointed."""
        return self.enabled and index % self.every == 0

    def count(self, n_layers: int, first: int = 0) -> int:
        """How many of the blocks first .. first + n_layers - 1 are checkpointed."""
        return sum(self.checkpoints(i) for i in range(first, first + n_layers))

    @property
    def label(self) -> str:
        """The mode as a user sets it: 'op', or 'op, checkpoint_every=2'."""
        if not self.enabled or self.every == 1:
            return self.mode.value
        return f"{self.mode.value}, checkpoint_every={self.every}"


def run_block(block: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, index: int,
              model: ModelConfig, training: bool) -> torch.Tensor:
    """Block `index`'s forward in training (no KV cache), checkpointed as `model` asks; in eval mode
    nothing is saved for backward anyway, so it runs plainly."""
    plan = CheckpointPlan.of(model)
    if not (training and plan.checkpoints(index)):
        return block(x, rope)
    if plan.mode is ActivationCheckpointing.full:
        return checkpoint(block, x, rope, use_reentrant=False)
    return checkpoint(block, x, rope, use_reentrant=False, context_fn=_OP_CONTEXTS)
