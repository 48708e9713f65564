"""The time a config's run will take, before it starts: training FLOPs per token (6N plus attention
over the keys a query sees: the context, or the sliding window when the model has one) against this
device's matmul rate, measured in the dtype the run computes in, at an assumed utilization (MFU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmtrain.config.derived import tokens_per_step, total_steps
from llmtrain.config.schema import Config
from llmtrain.engine.precision import matmul_dtype, resolve_precision
from llmtrain.monitor.probes import matmul_peak_flops
from llmtrain.preflight.estimate import ModelShape

# Model FLOPs utilization assumed for the time estimate (the health records in metrics.jsonl carry
# the measured one, "mfu"). CPU, measured on this project's 2-core machine against the same 1024^2
# matmul probe (fp32, fused AdamW, 2 threads; 1 thread by CPU time agrees within 0.05): 0.64-0.66
# for the 4x128 default (T 256, batch 16: small matmuls, per-op overhead), 0.77 for 6x256, 0.84-0.88
# for 6x384 and 0.87 for 12x768 (T 128, batch 4); in between linear in log2(width), flat outside.
# (An earlier table said 0.33 and 0.6: the default run then took 202 ms/step against ~405 estimated.)
# CUDA: gpt_small in bf16 (16 x 1024 tokens a step) on an H200 reached 0.34 of its measured bf16
# matmul rate eager and 0.40 compiled (docs/performance.md). MPS: a typical figure, not measured.
ASSUMED_MFU = {"cuda": 0.4, "mps": 0.3}
CPU_MFU_BY_WIDTH = ((128, 0.65), (384, 0.85))


@dataclass
class ComputeEstimate:
    flops_per_token: float
    tokens_per_step: int
    steps: int
    matmul_flops: float  # measured on this device, FLOP/s
    assumed_mfu: float
    matmul_dtype: str = "fp32"  # what matmul_flops was measured in: the run's compute precision

    @property
    def step_seconds(self) -> float:
        return self.flops_per_token * self.tokens_per_step / (self.matmul_flops * self.assumed_mfu)

    @property
    def run_seconds(self) -> float:
        return self.step_seconds * self.steps

    @property
    def tokens(self) -> int:
        return self.tokens_per_step * self.steps


def estimate_compute(cfg: Config, shape: ModelShape, device: torch.device, matmul_flops: float | None = None,
                     world_size: int = 1) -> ComputeEstimate:
    precision = resolve_precision(cfg.precision.name, device)  # fp32, bf16 or fp16
    rate = matmul_flops if matmul_flops is not None else matmul_peak_flops(device, matmul_dtype(precision))
    return ComputeEstimate(
        flops_per_token=shape.flops_per_token,
        tokens_per_step=tokens_per_step(cfg) // world_size,
        steps=total_steps(cfg, world_size),
        matmul_flops=rate,
        assumed_mfu=assumed_mfu(device.type, cfg.model.n_embd),
        matmul_dtype=precision.value,
    )


def assumed_mfu(device_type: str, width: int) -> float:
    if device_type != "cpu":
        return ASSUMED_MFU.get(device_type, 0.3)
    (w0, m0), (w1, m1) = CPU_MFU_BY_WIDTH
    t = min(1.0, max(0.0, (math.log2(width) - math.log2(w0)) / (math.log2(w1) - math.log2(w0))))
    return m0 + t * (m1 - m0)


def format_seconds(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"
