"""The pre-flight items about resources: whether the run fits in memory (and what would make it fit),
and how long it will take.

Each item is a function of (config, facts) giving a `Finding` (or None where it does not apply);
preflight/check.py lists them in the order the table shows."""

from __future__ import annotations

import copy

from llmtrain.config.schema import (
    ActivationCheckpointing,
    Config,
    OptimizerName,
    Precision,
)
from llmtrain.core.findings import Finding, Status
from llmtrain.preflight.estimate import (
    estimate_memory,
    format_bytes,
    format_seconds,
    largest_fitting_micro_batch,
    model_shape,
)
from llmtrain.preflight.facts import MEMORY_WARN_FRACTION, Facts


def check_memory(cfg: Config, facts: Facts) -> Finding:
    mem, budget = facts.memory, facts.memory_budget
    share = mem.peak / budget
    seen = f"peak {format_bytes(mem.peak)} of {format_bytes(budget)} ({share:.0%}, {facts.memory_source})"
    why = "Weights, gradients, optimizer state and activations must fit, or the run dies (OOM) after its set-up."
    if share <= MEMORY_WARN_FRACTION:
        return Finding("memory", Status.PASS, seen, why)
    return Finding("memory", Status.FAIL if share > 1 else Status.WARN, seen, why, memory_fixes(cfg, facts))


def memory_fixes(cfg: Config, facts: Facts) -> str:
    """Overrides that bring the peak under the budget, each with its predicted peak."""
    budget = facts.memory_budget * MEMORY_WARN_FRACTION
    mem = facts.memory
    common = dict(runtime_bytes=mem.runtime, data_bytes=mem.data)
    fixes = []
    micro = largest_fitting_micro_batch(cfg, facts.shape, facts.vocab_size, facts.device.type, facts.precision,
                                        budget, **common)
    if micro is not None and micro < cfg.micro_batch_size:
        accum = cfg.global_batch_size // micro
        fixes.append(f"micro_batch_size={micro} (accumulation {accum} keeps the global batch {cfg.global_batch_size})")
    if (cfg.model.activation_checkpointing, cfg.model.checkpoint_every) != (ActivationCheckpointing.full, 1):
        alt = copy.deepcopy(cfg)  # the most it saves: every block keeps only its input
        alt.model.activation_checkpointing, alt.model.checkpoint_every = ActivationCheckpointing.full, 1
        peak = estimate_memory(alt, facts.shape, facts.vocab_size, facts.device.type, facts.precision, **common).peak
        every = " model.checkpoint_every=1" if cfg.model.checkpoint_every != 1 else ""
        fixes.append(f"model.activation_checkpointing=full{every} (peak {format_bytes(peak)})")
    if cfg.optim.name in (OptimizerName.adamw, OptimizerName.adam):
        fixes.append(f"optim=adafactor (factored state: {format_bytes(mem.optimizer)} -> "
                     f"{format_bytes(_state_bytes_with(cfg, facts, OptimizerName.adafactor))})")
    if cfg.optim.name is OptimizerName.adamw:  # the same AdamW, its moments in 8 bits (a GPU saving, not a CPU one)
        fixes.append(f"optim=adamw8bit (8-bit moments: {format_bytes(mem.optimizer)} -> "
                     f"{format_bytes(_state_bytes_with(cfg, facts, OptimizerName.adamw8bit))}; "
                     "pip install 'llmtrain[ao]')")
    if facts.device.type == "cuda" and facts.precision is Precision.fp32:
        fixes.append("precision=auto (halves activations)")
    fixes.append("or shard weights/state across devices (ZeRO/FSDP)")
    return "; ".join(fixes)


def _state_bytes_with(cfg: Config, facts: Facts, name: OptimizerName) -> float:
    alt = copy.deepcopy(cfg)
    alt.optim.name = name
    return 4.0 * model_shape(alt, facts.vocab_size).optimizer_state_elements


def check_run_time(cfg: Config, facts: Facts) -> Finding | None:
    c = facts.compute
    if c is None:
        return None
    seen = (f"~{format_seconds(c.step_seconds)}/step, ~{format_seconds(c.run_seconds)} in all "
            f"({c.matmul_flops / 1e9:,.0f} GFLOP/s measured x {c.assumed_mfu:.0%} assumed MFU)")
    why = "Know the cost before starting: a run that takes days here belongs on a faster device."
    if c.run_seconds > 8 * 3600:  # longer than a night on this device
        return Finding("run time", Status.WARN, seen, why, "a GPU (device=cuda), a smaller model, or fewer steps")
    return Finding("run time", Status.PASS, seen, why)
