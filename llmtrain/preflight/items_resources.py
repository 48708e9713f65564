"""The pre-flight items about resources: whether the run fits in memory (and what would make it fit),
and how long it will take.

Each item is a function of (config, facts) giving a `Finding` (or None where it does not apply);
preflight/check.py lists them in the order the table shows."""

from __future__ import annotations

from llmtrain.config.schema import Config, Precision
from llmtrain.core.findings import Finding, Status
from llmtrain.preflight.compute import format_seconds
from llmtrain.preflight.estimate import format_bytes
from llmtrain.preflight.facts import MEMORY_WARN_FRACTION, Facts
from llmtrain.preflight.savers import EstimateBasis, memory_savers

SAVERS_SHOWN = 4  # the row names the cheapest few; `llmtrain plan` lists every one


def check_memory(cfg: Config, facts: Facts) -> Finding:
    mem, budget = facts.memory, facts.memory_budget
    share = mem.peak / budget
    seen = f"peak {format_bytes(mem.peak)} of {format_bytes(budget)} ({share:.0%}, {facts.memory_source})"
    why = "Weights, gradients, optimizer state and activations must fit, or the run dies (OOM) after its set-up."
    if share <= MEMORY_WARN_FRACTION:
        return Finding("memory", Status.PASS, seen, why)
    return Finding("memory", Status.FAIL if share > 1 else Status.WARN, seen, why, memory_fixes(cfg, facts))


def memory_fixes(cfg: Config, facts: Facts) -> str:
    """The savers that bring the peak within the margin (preflight/savers.py), cheapest first, each
    as its overrides with its predicted peak and cost; the nearest one when none does."""
    budget = facts.memory_budget * MEMORY_WARN_FRACTION
    savers = memory_savers(cfg, EstimateBasis.of_facts(facts), budget)
    shown = savers[:SAVERS_SHOWN]
    fixes = [s.describe() for s in shown]
    if not savers or not savers[0].fits:
        nearest = f"nothing fits {format_bytes(budget)}; nearest: " if savers else "nothing here fits: "
        fixes = [nearest + (fixes[0] if fixes else "a smaller model, or a device with more memory")]
    if len(savers) > len(shown):
        fixes.append(f"{len(savers) - len(shown)} more: llmtrain plan lists them")
    if facts.device.type == "cuda" and facts.precision is Precision.fp32:
        fixes.append("precision=auto (halves activations)")
    return "; ".join(fixes) + " (preset=memory_saver applies the first)" * bool(savers and savers[0].fits)


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
