"""Numeric precision: an autocast context for the forward pass and, for fp16, a dynamic loss scaler.

The loop, recovery and checkpoints see one `NumericPrecision` object (`build_precision`) with a
method for each thing they do with the precision: run the forward in `autocast()`, `backward`,
`unscale` before clipping, judge a step `is_finite`, `step` the optimizer, read the `loss_scale`,
and keep its `state_dict` in checkpoints. Without loss scaling each of these is the plain
operation; `LossScaledPrecision` (fp16 with its GradScaler) overrides them, so no caller asks
whether there is a scaler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager

import torch

from llmtrain.config.schema import Precision, PrecisionConfig

_DTYPES = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}


def native_bf16() -> bool:
    """Whether the current GPU computes in bf16 natively (Ampere and newer); emulation is slow."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch without the keyword
        return torch.cuda.is_bf16_supported()


def resolve_precision(name: Precision, device: torch.device) -> Precision:
    """`auto`: mixed precision where the hardware gains from it. On CUDA bf16 when supported (no loss
    scaling needed), else fp16 with its scaler; on CPU and MPS fp32, measured fastest there."""
    if name is not Precision.auto:
        return name
    if device.type == "cuda":
        return Precision.bf16 if native_bf16() else Precision.fp16
    return Precision.fp32


def autocast_dtype(name: Precision) -> torch.dtype | None:
    """The dtype a resolved precision computes its matmuls in under autocast; None for fp32."""
    return _DTYPES.get(name)


def matmul_dtype(name: Precision) -> torch.dtype:
    """The dtype a resolved precision's matmuls run in: autocast's, else fp32 (the MFU reference's)."""
    return _DTYPES.get(name, torch.float32)


def autocast_factory(cfg: PrecisionConfig, device_type: str) -> Callable[[], ContextManager]:
    """A zero-argument callable returning the context to run the forward pass (and loss) in."""
    name = resolve_precision(cfg.name, torch.device(device_type))
    if name is Precision.fp32:
        return contextlib.nullcontext
    dtype = _DTYPES[name]
    return lambda: torch.autocast(device_type=device_type, dtype=dtype)


def build_grad_scaler(cfg: PrecisionConfig, device_type: str) -> torch.amp.GradScaler | None:
    """fp16 gradients underflow without loss scaling; bf16 and fp32 need none."""
    if resolve_precision(cfg.name, torch.device(device_type)) is not Precision.fp16 or not cfg.loss_scaling:
        return None
    return torch.amp.GradScaler(device_type, init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)


class NumericPrecision:
    """The precision of a run without loss scaling (fp32, bf16, or fp16 with loss_scaling=false):
    autocast for the forward, and every other operation the plain one."""

    loss_scaling = False

    def __init__(self, autocast: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        # A zero-argument factory, handed on as is to evaluation and scoring (evaluate(), Scorer).
        self.autocast = autocast

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients as they are: nothing scaled them."""

    def is_finite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """The step's one host sync: a NaN/Inf loss or gradient must never reach the weights."""
        return bool(torch.isfinite(loss) & torch.isfinite(grad_norm))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def loss_scale(self) -> float | None:
        """The current loss scale (for the logs and the monitor); None: the loss is not scaled."""
        return None

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps of the precision (its `scaler` entry); None: nothing."""
        return None

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's loss-scaler state has nothing to go into here: a run that changed to
        another precision resumes without it."""


class LossScaledPrecision(NumericPrecision):
    """fp16 with a dynamic loss scaler: the backward of the scaled loss, the gradients unscaled
    before clipping, the optimizer step through the scaler (which skips a step whose gradients
    overflowed and lowers the scale), and the scaler's state in checkpoints."""

    loss_scaling = True

    def __init__(self, autocast: Callable[[], ContextManager], scaler: torch.amp.GradScaler) -> None:
        super().__init__(autocast)
        self.scaler = scaler

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones

    def is_finite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Only the loss: an inf gradient is the scaler's business (it skips the step and rescales)."""
        return bool(torch.isfinite(loss))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)  # skips the step if the gradients overflowed
        self.scaler.update()

    def loss_scale(self) -> float | None:
        return self.scaler.get_scale()

    def state_dict(self) -> dict | None:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if state is not None:  # a checkpoint of a run without loss scaling has none
            self.scaler.load_state_dict(state)


def with_scaler(autocast: Callable[[], ContextManager], scaler: torch.amp.GradScaler | None) -> NumericPrecision:
    """The precision object of an autocast factory and an optional scaler (as the doctor builds them)."""
    return NumericPrecision(autocast) if scaler is None else LossScaledPrecision(autocast, scaler)


def build_precision(cfg: PrecisionConfig, device_type: str) -> NumericPrecision:
    """The run's precision: autocast as `precision.name` resolves on this device, and fp16's loss
    scaler when `precision.loss_scaling` is on."""
    return with_scaler(autocast_factory(cfg, device_type), build_grad_scaler(cfg, device_type))
