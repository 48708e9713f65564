"""Torch-side measurements for the health monitor, taken only on check steps.

Everything here returns tensors on the device (no host sync); the loop turns one stacked tensor into
floats once per check.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from llmtrain.distributed.wrapping import local_value


class ActivationProbe:
    """Forward hooks on each block that record the output's mean and variance of the first call
    (the step's first micro-batch). Installed for one sampled step, removed right after."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.means: list[torch.Tensor | None] = [None] * len(blocks)
        self.vars: list[torch.Tensor | None] = [None] * len(blocks)
        self.handles = [block.register_forward_hook(self._hook(i)) for i, block in enumerate(blocks)]

    def _hook(self, index: int):  # noqa: ANN202 - a torch hook
        def record(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            if self.means[index] is None:
                out = output.detach().float()
                self.means[index], self.vars[index] = out.mean(), out.var()

        return record

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def stats(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        if any(m is None for m in self.means):
            return None
        return list(self.means), list(self.vars)


@dataclass(frozen=True)
class BlockSpan:
    """What this process measures of the model: its blocks, by their index in the whole model, and
    the parameters it counts in the totals; `join` sums a tensor over the processes holding the
    rest (pipeline stages each hold some blocks; otherwise a process holds them all: `whole`)."""

    modules: list[nn.Module]
    indices: list[int]
    count: int
    params: list[torch.Tensor]
    join: Callable[[torch.Tensor], torch.Tensor] | None = None  # None: this process holds the whole model

    @classmethod
    def whole(cls, model: nn.Module) -> BlockSpan:
        blocks = list(model.blocks)
        return cls(blocks, list(range(len(blocks))), len(blocks), [p for p in model.parameters() if p.requires_grad])

    def per_block(self, values: torch.Tensor, squared: bool = False) -> torch.Tensor:
        """Values of this process's blocks -> one per block of the model: summed over the processes
        (each block's held by one), norms through their squares."""
        if self.join is None:
            return values
        spread = torch.zeros(self.count, device=values.device, dtype=values.dtype)
        spread[self.indices] = values * values if squared else values
        joined = self.join(spread)
        return joined.sqrt() if squared else joined

    def norm(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of `tensors` over all processes (each holding its share)."""
        local = total_norm(tensors)
        return local if self.join is None else self.join(local * local).sqrt()


def moment_sums(optimizer: torch.optim.Optimizer | None, params: list[torch.Tensor]) -> torch.Tensor:
    """Adam's first moment squared and its second moment, each summed over the parameters whose
    optimizer state holds both as plain (or FSDP2-sharded) tensors: two elements, zeros for an
    optimizer without them (SGD, Adafactor, 8-bit states). Their ratio is the gradient's consistency
    from step to step: ~(1 - beta1) / (1 + beta1) for gradients that are mostly noise, ~1 for a
    gradient that stays the same."""
    first, second = [], []
    for p in params:
        # ZeRO keeps other ranks' parameters' state as None: only what this process holds counts.
        state = (optimizer.state.get(p) if optimizer is not None else None) or {}
        m, v = state.get("exp_avg"), state.get("exp_avg_sq")
        if _plain(m) and _plain(v):
            first.append(m)
            second.append(v)
    if not first:
        device = params[0].device if params else torch.device("cpu")
        return torch.zeros(2, device=device)
    # The second moment is never negative: its sum is its L1 norm.
    return torch.stack([tensor_norms(first).square().sum(), tensor_norms(second, 1.0).sum()])


def _plain(tensor: object) -> bool:
    """A tensor whose values sum as they are: not a quantized optimizer state (torchao's 8-bit)."""
    return isinstance(tensor, torch.Tensor) and type(tensor).__name__ in ("Tensor", "Parameter", "DTensor")


def block_norms(blocks: list[list[torch.Tensor]], grads: bool) -> torch.Tensor:
    """L2 norm of each block's gradients (grads=True) or parameters, as one tensor of shape (blocks,);
    `blocks` holds each block's parameters (listed once: walking the modules at every check took
    longer than the norms)."""
    if not blocks:
        return torch.zeros(0)
    tensors, counts = [], []
    for params in blocks:
        mine = [p.grad if grads else p for p in params if p.grad is not None or not grads]
        tensors += mine
        counts.append(len(mine))
    if not tensors:
        return torch.zeros(len(blocks), device=blocks[0][0].device)
    # Each block's share of the one list of norms (no index tensor: copying one to a GPU would sync).
    squares = tensor_norms(tensors).square()
    return torch.stack([part.sum() for part in squares.split(counts)]).sqrt()


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(tensor_norms(tensors))


@torch.no_grad()  # no `detach` per tensor: hundreds of calls for nothing
def tensor_norms(tensors: list[torch.Tensor], ord: float = 2.0) -> torch.Tensor:
    """Each tensor's norm (fp32), as one tensor of shape (len(tensors),) on the first one's device.
    Plain fp32 tensors there go through one fused multi-tensor kernel: on a GPU the loop has just
    synced, so the device idles while a check launches its kernels, and one norm per tensor made the
    monitor cost ~10% of a 124M model's step on an H200. The rest one by one (FSDP2's DTensors reduce
    over their shards, NF4 weights dequantize, bf16 is widened first)."""
    if not tensors:
        return torch.zeros(0)
    device = tensors[0].device
    norms: list[torch.Tensor | None] = [None] * len(tensors)
    fused = [i for i, t in enumerate(tensors) if _fusable(t, device)]
    if fused:
        for i, norm in zip(fused, torch._foreach_norm([tensors[i] for i in fused], ord)):
            norms[i] = norm
    return torch.stack([norm if norm is not None else _norm(tensor, ord).to(device)
                        for norm, tensor in zip(norms, tensors)])


@torch.no_grad()
def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` as they are now (fused when all are plain fp32 tensors on one device)."""
    if tensors and all(_fusable(t, tensors[0].device) for t in tensors):
        return torch._foreach_mul(tensors, 1.0)
    return [t.clone() for t in tensors]


@torch.no_grad()
def subtract_in_place(before: list[torch.Tensor], after: list[torch.Tensor]) -> list[torch.Tensor]:
    """`before` -= `after`, in place (fused when all are plain fp32 tensors on one device): the
    negated change, in the memory of the snapshot, which a new set of differences would double
    (another copy of every trainable weight, for a moment, at each check)."""
    if before and all(_fusable(t, before[0].device) for t in (*before, *after)):
        torch._foreach_sub_(before, after)
    else:
        for b, a in zip(before, after):
            b.sub_(a)
    return before


def _fusable(tensor: torch.Tensor, device: torch.device) -> bool:
    """A plain fp32 tensor on `device`: torch's multi-tensor (`_foreach_*`) kernels take it as it is."""
    return type(tensor) in (torch.Tensor, nn.Parameter) and tensor.dtype == torch.float32 and tensor.device == device


def _norm(tensor: torch.Tensor, ord: float = 2.0) -> torch.Tensor:
    """The norm as a plain tensor; for a parameter sharded by FSDP2 (a DTensor) over all its shards.
    `.to(float32)`, not `.float()`: QLoRA's NF4 weights (float32 already) dequantize only through `to`."""
    return local_value(torch.linalg.vector_norm(tensor.detach().to(torch.float32), ord))


def rss_mb() -> float:
    """Resident memory of this process in MB (current on Linux, peak elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def cuda_memory_mb(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {
        "cuda_allocated_mb": torch.cuda.memory_allocated(device) / 2**20,
        "cuda_reserved_mb": torch.cuda.memory_reserved(device) / 2**20,
        "cuda_peak_mb": torch.cuda.max_memory_allocated(device) / 2**20,
    }


def matmul_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, repeats: int = 8) -> float:
    """This device's achievable matmul rate (FLOP/s) in `dtype`, measured in a fraction of a second:
    the reference for MFU (model FLOPs utilization). In the dtype the run's matmuls use: a bf16 run on
    an H200 computes ~24x its fp32 rate (28.5 TFLOP/s), and its MFU read 960% against fp32. Square products
    of 4,096 on a GPU (one of 1,024 takes microseconds there: too short to time against its launch),
    1,024 elsewhere."""
    import time

    size = 4096 if device.type == "cuda" else 1024
    # A private generator: measuring must not move the training RNG (dropout, exact resume).
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator).to(dtype)
    b = torch.randn(size, size, device=device, generator=generator).to(dtype)
    for _ in range(2):  # warm-up: kernels, caches, clocks
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # The fastest of `repeats` single products: the rate the device achieves, which one matmul slowed
    # by another process (a busy CPU core) would otherwise pull down for the whole run's estimate.
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        c = a @ b
        c[0, 0].item()  # waits for the device
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * size**3 / fastest


def peak_rss_mb() -> float:
    """The highest resident memory this process reached, in MB (VmHWM on Linux)."""
    try:
        for line in open("/proc/self/status").read().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def device_memory_mb(device: torch.device) -> float | None:
    """All the memory a run on `device` could use, in MB: the GPU's, or the host's (its cgroup
    limit when that is lower), the figure peak memory is measured against."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**20
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit.isdigit():
            total = min(total, int(limit) / 2**20)
    except OSError:
        pass
    return total
