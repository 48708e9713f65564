"""One optimizer step's maths: the masked loss sum, gradient accumulation over a window of
micro-batches, clipping, and evaluation on fixed batches. The finiteness check and the update are
the precision's (engine/precision.py): under fp16 loss scaling they go through the scaler."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager as ContextManager

import torch
import torch.nn.functional as F

from llmtrain.config.schema import OptimConfig
from llmtrain.data.sampler import IGNORE_INDEX
from llmtrain.engine.optim import clip_gradients
from llmtrain.engine.precision import NumericPrecision
from llmtrain.engine.timing import StepTimer

Batch = tuple[torch.Tensor, torch.Tensor]


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Summed cross-entropy over real tokens; targets equal to IGNORE_INDEX (prompt tokens,
    padding) count for nothing."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum",
        label_smoothing=label_smoothing,
    )


def count_tokens(batches: Iterable[Batch]) -> int:
    """Real (non-ignored) target tokens in a window, counted on the host before the batches move."""
    return int(sum(int((y != IGNORE_INDEX).sum()) for _, y in batches))


@contextlib.contextmanager
def deferred_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """No gradient communication inside (DDP's no_sync; FSDP2 holds its reduce-scatter)."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with model.no_sync():
            yield


def accumulate_window(
    model: torch.nn.Module,
    batches: list[Batch],
    device: torch.device,
    precision: NumericPrecision,
    timer: StepTimer,
    *,
    label_smoothing: float = 0.0,
    n_tokens: int | None = None,
    world_size: int = 1,
) -> torch.Tensor:
    """Forward/backward over one accumulation window; returns the window's mean loss (a tensor).

    The loss is summed over real tokens and divided by `n_tokens`, the window's tokens over all
    ranks (default: this window's). Under DDP, which averages the ranks' gradients, each rank's
    loss is also multiplied by `world_size`, and gradients are synchronized once, on the window's
    last micro-batch (no_sync before): the result is the gradient one process would compute.
    `precision` runs the forward in its autocast and the backward (of the scaled loss, under fp16
    loss scaling); `timer` (on sampled steps) times the copies to the device, each forward and
    each backward."""
    n_tokens = max(1, n_tokens if n_tokens is not None else count_tokens(batches))
    window_loss = torch.zeros((), device=device)
    for i, (x, y) in enumerate(batches):
        if device.type == "cuda":  # page-locked: the copy runs asynchronously (nanoGPT does the same)
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        timer.lap("data")
        defer_sync = world_size > 1 and i < len(batches) - 1
        with deferred_gradient_sync(model) if defer_sync else contextlib.nullcontext():
            with precision.autocast():
                loss = loss_sum(model(x), y, label_smoothing) / n_tokens
                if world_size > 1:
                    loss = loss * world_size
            timer.lap("forward")
            precision.backward(loss)
        timer.lap("backward")
        window_loss += loss.detach()
    return window_loss


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[Batch], device: torch.device,
             autocast: Callable[[], ContextManager]) -> float:
    """Mean loss per real token over fixed batches, in eval mode (dropout off); restores train mode."""
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float32 if device.type == "mps" else torch.float64)
    for x, y in batches:
        with autocast():
            total += loss_sum(model(x.to(device)), y.to(device)).to(total.dtype)
    model.train()
    return total.item() / max(1, count_tokens(batches))


def unscale_and_clip(optimizer: torch.optim.Optimizer, precision: NumericPrecision,
                     params: list[torch.nn.Parameter], cfg: OptimConfig) -> torch.Tensor:
    """The window's gradient norm, clipped as configured (a tensor: no host sync); under fp16 loss
    scaling the true gradients are clipped, unscaled first."""
    precision.unscale(optimizer)
    return clip_gradients(params, cfg)
