"""Optimizer construction (parameter groups without decay on biases/norms) and gradient clipping."""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmtrain.config.derived import default_lr
from llmtrain.config.schema import OptimConfig, OptimizerName
from llmtrain.distributed.wrapping import local_value

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
