"""The pre-flight checklist: settings that make training stable, plus static checks of the model
and data (docs/checklist.md says where each item comes from).

`run_check(cfg)` looks at a validated config and this machine and returns one row per item, a
`Finding` (core/findings.py): PASS, WARN or FAIL, the value it saw, one line on why it matters, and
the override that fixes it.
`llmtrain check` prints the table (exit 0 all pass, 1 warnings, 2 failures); `llmtrain train` runs
the same check before any work and refuses to start on a FAIL unless allow_check_failures=true.

Each item is a small function of (config, facts), in the module of its area (items_data.py,
items_optimization.py, items_model.py, items_resources.py); facts are what the machine and the data
say (device, precision, token counts, the memory and compute estimates: facts.py); render.py prints
the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmtrain.config.schema import (
    Config,
)
from llmtrain.core.errors import UserError
from llmtrain.core.findings import Finding, Status
from llmtrain.preflight.facts import Facts, gather_facts
from llmtrain.preflight.items_data import check_data_content, check_data_order, check_token_budget, check_vocabulary
from llmtrain.preflight.items_model import (
    check_init,
    check_precision,
    check_residual_norm,
    check_seed,
    check_train_mode,
)
from llmtrain.preflight.items_optimization import (
    check_clipping,
    check_effective_batch,
    check_learning_rate,
    check_momentum,
    check_schedule_length,
    check_warmup,
)
from llmtrain.preflight.items_resources import check_memory, check_run_time

EXIT_PASS, EXIT_WARN, EXIT_FAIL = 0, 1, 2


class CheckFailed(UserError):
    """The pre-flight check found FAIL rows and the user did not allow them."""

    def __init__(self, message: str, report: CheckReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class CheckReport:
    rows: list[Finding]
    facts: Facts

    @property
    def failures(self) -> list[Finding]:
        return [r for r in self.rows if r.status is Status.FAIL]

    @property
    def warnings(self) -> list[Finding]:
        return [r for r in self.rows if r.status is Status.WARN]

    @property
    def exit_code(self) -> int:
        return EXIT_FAIL if self.failures else EXIT_WARN if self.warnings else EXIT_PASS

    def row(self, item: str) -> Finding:
        return next(r for r in self.rows if r.item == item)

    def refusal(self) -> str:
        names = ", ".join(f"{r.item} ({r.seen})" for r in self.failures)
        fixes = "; ".join(f"{r.item}: {r.fix}" for r in self.failures if r.fix)
        return (
            f"the pre-flight check failed on {len(self.failures)} item(s): {names}. Fix: {fixes}. "
            "To train anyway, add allow_check_failures=true (the rows above say what will go wrong)."
        )


ITEMS: list[Callable[[Config, Facts], Finding | None]] = [
    check_data_content, check_data_order, check_warmup, check_schedule_length, check_clipping, check_precision,
    check_memory, check_train_mode, check_seed, check_effective_batch, check_learning_rate, check_momentum,
    check_vocabulary, check_residual_norm, check_init, check_token_budget, check_run_time,
]


def run_check(cfg: Config, measure_compute: bool = True, data_meta: dict | None = None,
              matmul_flops: float | None = None) -> CheckReport:
    """The checklist for `cfg` on this machine; `matmul_flops` (FLOP/s) gives the compute estimate's
    device rate instead of measuring it, as tests do: a busy machine reads low and must not decide
    what a test sees."""
    facts = gather_facts(cfg, measure_compute=measure_compute, data_meta=data_meta, matmul_flops=matmul_flops)
    rows = [row for item in ITEMS if (row := item(cfg, facts)) is not None]
    return CheckReport(rows, facts)


