"""Optimizer construction (parameter groups without decay on biases/norms) and gradient clipping."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from llmtrain.config.derived import default_lr
from llmtrain.config.schema import LOW_BIT_OPTIMIZERS, OptimConfig, OptimizerName
from llmtrain.core.quiet import quiet_torchao
from llmtrain.distributed.wrapping import local_tensor, local_value

log = logging.getLogger(__name__)


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Decay only matrices: biases and norm scales (1-D) never, embeddings as configured."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        is_embedding = id(param) in embedding_ids
        if param.ndim >= 2 and (cfg.decay_embeddings or not is_embedding):
            decay.append(param)
        else:
            no_decay.append(param)
    return [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig, device_type: str,
                    fused_ok: bool = True) -> torch.optim.Optimizer:
    """`fused_ok=False` (parameters sharded by FSDP2, DTensors): the foreach implementation."""
    groups = param_groups(model, cfg)
    lr = cfg.lr if cfg.lr is not None else _default_lr_for(model, cfg)
    if cfg.name is OptimizerName.sgd:
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)
    if cfg.name is OptimizerName.adafactor:
        # Adafactor's own defaults for its two epsilons (the Adam-style optim.eps does not apply).
        return torch.optim.Adafactor(groups, lr=lr)
    if cfg.name in LOW_BIT_OPTIMIZERS:
        # torchao's default block sizes (256 for 8-bit, 128 for 4-bit); no fused flag: it compiles its own step.
        cls = low_bit_optimizer_class(cfg.name)
        return cls(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    cls = torch.optim.AdamW if cfg.name is OptimizerName.adamw else torch.optim.Adam
    kwargs = dict(lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    # Fused kernels step ~3x faster on CPU here and are the fastest path on CUDA.
    want_fused = fused_ok and (cfg.fused if cfg.fused is not None else device_type in ("cpu", "cuda"))
    if want_fused:
        try:
            return cls(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError) as err:
            if cfg.fused:
                log.warning("fused %s unavailable here (%s); using the default implementation", cls.__name__, err)
    return cls(groups, **kwargs)


def set_lr(group: dict, lr: float) -> None:
    """Set a parameter group's LR in the form its optimizer holds it: torchao's low-bit optimizers
    keep it as a 0-d tensor (their compiled step reads it without recompiling) and refuse a float
    there, so it is filled in place; every other optimizer holds a float."""
    current = group.get("lr")
    if isinstance(current, torch.Tensor):
        current.fill_(lr)
    else:
        group["lr"] = lr


def low_bit_optimizer_class(name: OptimizerName) -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit or AdamW4bit, imported on first use (torchao is the optional `ao` extra;
    config validation refuses these optimizers without it)."""
    optim = import_torchao_optim()
    return optim.AdamW8bit if name is OptimizerName.adamw8bit else optim.AdamW4bit


def import_torchao_optim() -> Any:
    """torchao.optim; importing it also registers its optimizer-state tensor types with torch.load's
    weights_only allowlist, which loading a checkpoint of these optimizers needs. Its import logs a
    warning for each C++ extension it cannot load (CUDA kernels for formats llmtrain does not use)
    and its first step warns about AOT caching; neither concerns the optimizer (core/quiet.py)."""
    with quiet_torchao():
        import torchao.optim as optim
    return optim


def requantize_state(optimizer: torch.optim.Optimizer) -> None:
    """Put float moments back into torchao's quantized form, in place: a sharded checkpoint read whole
    (in one process, checkpoint/shards.py read_full) hands them over dequantized, and a low-bit
    optimizer would otherwise keep them in float32 for the rest of the run. Requantizing the signed
    first moment is not bit-exact (within the quantization step); anything else is left as it is."""
    new_buffer = getattr(optimizer, "_new_buffer", None)
    if new_buffer is None or not type(optimizer).__module__.startswith("torchao."):
        return
    for param, state in optimizer.state.items():
        for key, signed in (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False)):
            value = state.get(key)
            if not isinstance(value, torch.Tensor) or _is_quantized(value):
                continue
            quantized = new_buffer(param, signed)
            if _is_quantized(quantized):
                target = local_tensor(quantized)
                target.copy_(local_tensor(value).to(target.device))
                state[key] = quantized


def dequantized(state_dict: dict) -> dict:
    """An optimizer state_dict with torchao's quantized moments as float tensors (a shallow copy): torch
    splits float tensors across FSDP2's ranks, not torchao's types (`requantize_state` undoes it)."""
    state = {index: {key: value.dequantize() if _is_quantized(value) else value for key, value in entries.items()}
             for index, entries in state_dict.get("state", {}).items()}
    return {**state_dict, "state": state}


def _is_quantized(tensor: torch.Tensor) -> bool:
    """torchao's quantized optimizer state (OptimState8bit/4bit: codes and block scales), sharded or not."""
    return hasattr(local_tensor(tensor), "codes")


def _default_lr_for(model: nn.Module, cfg: OptimConfig) -> float:
    """A null lr of a config that `validate` never saw (which fills it in): the default for the
    model's width, as `optim.lr=null` means."""
    width = getattr(getattr(model, "cfg", None), "n_embd", None)
    if width is None:
        raise ValueError("optim.lr is null and the model has no cfg.n_embd to take the default LR from; "
                         "validate the config first (it fills in the default) or set optim.lr")
    return default_lr(cfg.name, width)


def clip_gradients(params: list[torch.Tensor], cfg: OptimConfig) -> torch.Tensor:
    """Clip as configured and return the pre-clip global grad norm (a tensor: no host sync)."""
    if cfg.clip_grad_norm is not None:  # over FSDP2's sharded gradients the norm comes back as a DTensor
        return local_value(torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad_norm))
    norm = local_value(grad_norm(params))
    if cfg.clip_grad_value is not None:
        torch.nn.utils.clip_grad_value_(params, cfg.clip_grad_value)
    return norm


def grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of the gradients, without rescaling them (clip_grad_norm_ with an infinite
    threshold would still multiply every gradient by 1)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: foreach kernels
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
