"""The pre-flight check's output: the table of rows (`render`), a refusal's failing rows and the
command that shows them all (`render_refusal`), both through the findings renderers
(core/findings.py), and the memory and compute estimates under the table (`estimate_summary`)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

from llmtrain.core.console import default_console
from llmtrain.core.findings import Column, Status, badge, render_lines, render_table
from llmtrain.preflight.check import CheckReport
from llmtrain.preflight.compute import format_seconds
from llmtrain.preflight.estimate import describe_footprint, format_bytes
from llmtrain.preflight.facts import TOKENS_PER_PARAM, Facts
from llmtrain.preflight.parameters import WITHOUT_EMBEDDINGS, trainable_text

# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------

COLUMNS = [Column("item", "item", {"no_wrap": True}), Column("", "status", {"no_wrap": True}),
           Column("seen", "seen", {"ratio": 3}), Column("why it matters", "why", {"ratio": 4}),
           Column("fix", "fix", {"ratio": 3})]


def render(report: CheckReport, console: Console | None = None, estimates: bool = True) -> None:
    console = console or default_console()  # piped: a wide table, no padding, unwrapped lines
    render_table(console, report.rows, COLUMNS, "llmtrain check: pre-flight checklist", title_justify="left")
    if estimates:
        console.print(estimate_summary(report.facts))
    counts = {s: sum(r.status is s for r in report.rows) for s in (Status.PASS, Status.WARN, Status.FAIL)}
    console.print(f"{counts[Status.PASS]} pass, {counts[Status.WARN]} warn, {counts[Status.FAIL]} fail "
                  f"-> exit {report.exit_code}")


def render_refusal(report: CheckReport, console: Console, full_table: str) -> None:
    """What a refused start prints: the FAIL rows only, how many rows were not shown, and
    `full_table`, the command that prints them all with the estimates (`check_command_line`). The
    whole table is ~180 columns of mostly passing rows; the refusal is about the failing ones."""
    failures, warnings = report.failures, report.warnings
    passed = len(report.rows) - len(failures) - len(warnings)
    hidden = ", ".join(f"{n} {label}" for n, label in ((len(warnings), "warn"), (passed, "pass")) if n)
    console.print(f"[bold]pre-flight check[/]: {badge(Status.FAIL)} on {len(failures)} of {len(report.rows)} "
                  f"items{f' ({hidden} not shown)' if hidden else ''}")
    render_lines(console, failures, reasons=True)
    console.print(f"  the full table{' (the warnings too)' if warnings else ''}, with the memory and compute estimate:")
    console.print(f"    {escape(full_table)}", highlight=False, soft_wrap=True)  # one line, to copy whole


def check_command_line(overrides: Sequence[str] | None, config_dir: str | None = None) -> str:
    """`llmtrain check` with a run's overrides, which composes the config the run was refused for:
    its run dir (hydra.*, out_dir) dropped, since check writes nothing. `overrides` None (a config
    built in code, not from a command line): the bare command, with a word on what to add."""
    if overrides is None:
        return "llmtrain check  (with the overrides that make this config)"
    return shlex.join(["llmtrain", "check", *(["-cd", config_dir] if config_dir else []), *_without_run_dir(overrides)])


def rerun_command_line(overrides: Sequence[str] | None, config_dir: str | None, changes: dict[str, str]) -> str:
    """`llmtrain train` with a run's overrides and `changes` (key -> value) replacing or added to
    them: a new run (its run dir dropped, so it gets a fresh one) with a fix applied."""
    kept = [o for o in _without_run_dir(overrides or []) if o.lstrip("+~").split("=", 1)[0] not in changes]
    return shlex.join(["llmtrain", "train", *(["-cd", config_dir] if config_dir else []), *kept,
                       *(f"{key}={value}" for key, value in changes.items())])


def _without_run_dir(overrides: Sequence[str]) -> list[str]:
    return [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/", "out_dir="))]


def estimate_summary(facts: Facts) -> str:
    mem = facts.memory
    lines = [f"[bold]memory per process[/] ({facts.device}, {facts.precision.value}, micro-batch "
             f"{mem.micro_batch_size}; {facts.data_note}):"]
    lines += [f"  {name:<40} {format_bytes(value):>12}" for name, value in mem.rows() if value]
    if facts.shape.adapter_params:
        adapters = trainable_text(facts.shape.adapter_params, facts.shape.n_params + facts.shape.adapter_params)
        lines.append(f"  (LoRA: gradients and optimizer state for the {adapters} only)")
    if facts.shape.nf4_params:
        lines.append(f"  (QLoRA: the weights hold {describe_footprint(facts.shape.nf4_params, facts.shape.nf4_bytes)})")
    lines.append(f"  {'predicted peak':<40} {format_bytes(mem.peak):>12}   budget {format_bytes(facts.memory_budget)} "
                 f"({facts.memory_source})")
    if facts.fitting_micro_batch is None:
        lines.append("  no micro-batch fits in 85% of the budget: see the memory row's fixes")
    else:
        lines.append(f"  largest micro-batch within 85% of the budget: {facts.fitting_micro_batch} "
                     f"(a divisor of the global batch; accumulation makes up the rest)")
    if facts.layout_world:
        lines.append(f"  per rank over {facts.layout_over}: "
                     + ", ".join(f"{name} {format_bytes(peak)}" for name, peak in facts.layout_peaks.items()))
    c = facts.compute
    if c is not None:
        lines += [
            "[bold]compute[/]:",
            f"  {c.flops_per_token / 1e6:,.1f} MFLOP/token (6N + attention) x {c.tokens_per_step:,} tokens/step; "
            f"{c.steps:,} steps",
            f"  this device: {c.matmul_flops / 1e9:,.0f} GFLOP/s {c.matmul_dtype} matmul "
            f"({'measured now' if facts.rate_measured_now else 'measured before'}); at {c.assumed_mfu:.0%} MFU "
            f"~{format_seconds(c.step_seconds)}/step, ~{format_seconds(c.run_seconds)} for the run",
            f"  {c.tokens:,} tokens / {facts.parameters.without_embeddings:,} parameters {WITHOUT_EMBEDDINGS} = "
            f"{facts.parameters.tokens_per_param(c.tokens):.1f} tokens/param (~{TOKENS_PER_PARAM} is compute-optimal)",
        ]
    if facts.depth:
        lines.append(f"  {facts.depth}")
    return "\n".join(lines)
