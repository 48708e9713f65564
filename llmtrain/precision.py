"""Numeric precision: an autocast context for the forward pass and, for fp16, a dynamic loss scaler."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager

import torch

from llmtrain.config import Precision, PrecisionConfig

_DTYPES = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}


def autocast_factory(cfg: PrecisionConfig, device_type: str) -> Callable[[], ContextManager]:
    """A zero-argument callable returning the context to run the forward pass (and loss) in."""
    if cfg.name is Precision.fp32:
        return contextlib.nullcontext
    dtype = _DTYPES[cfg.name]
    return lambda: torch.autocast(device_type=device_type, dtype=dtype)


def build_grad_scaler(cfg: PrecisionConfig, device_type: str) -> torch.amp.GradScaler | None:
    """fp16 gradients underflow without loss scaling; bf16 and fp32 need none."""
    if cfg.name is not Precision.fp16 or not cfg.loss_scaling:
        return None
    return torch.amp.GradScaler(device_type, init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)
