"""Numeric precision: an autocast context for the forward pass and, for fp16, a dynamic loss scaler."""

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
