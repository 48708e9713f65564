"""What a report is made of: a question's `Verdict` (a `Finding`, core/findings.py, with the report's
own extras), the `RunEvidence` every question reads, the Evaluation section, the `Report`, the
statuses, and the record helpers the questions share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmtrain.core.files import (
    EVENTS,
    METRICS,
    Kind,
)
from llmtrain.core.findings import Finding, Status
from llmtrain.runs.records import Record, Records

# The report's statuses are the findings' (a report says them as words: ok, warn, fail, n/a).
OK, WARN, FAIL, NA = Status.PASS, Status.WARN, Status.FAIL, Status.NA


@dataclass
class Verdict:
    """A question's answer: the Finding (item: the question; seen: the answer in a sentence; details:
    the numbers behind it) and what only the report has: the key (the section's anchor and the
    question's stable name), the plots under its section and the steps its loss plot marks."""

    key: str
    answer: Finding
    plots: list[str] = field(default_factory=list)  # PNG names under report/
    marks: list[int] = field(default_factory=list)  # steps to mark on the loss plot (the spikes)

    @property
    def question(self) -> str:
        return self.answer.item

    @property
    def status(self) -> Status:
        return self.answer.status

    @property
    def finding(self) -> str:
        """The answer in one sentence (the Finding's `seen`): the report's "finding" column."""
        return self.answer.seen

    @property
    def details(self) -> list[str]:
        return self.answer.details


@dataclass
class RunEvidence:
    """What the questions read: the run dir, its records and config (None when config.yaml is missing
    or unreadable), the unigram baseline build_report found, and whether to reload the weights."""

    run_dir: Path
    records: Records
    cfg: Any
    baseline: float | None
    inference: bool = True

    @property
    def spike_z(self) -> float:
        return self.cfg.monitor.spike_z if self.cfg is not None else 6.0


@dataclass
class Evaluation:
    """The Evaluation section: what the evaluation tasks measured, as information (no verdict: a
    task's score has no threshold that holds for every model and data set)."""

    summary: str  # one line, for the terminal
    saved: str | None = None  # what eval.json is (or why it cannot be read); its tasks are the rows
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # eval.json: (task, kind, metrics, scored)
    training: str | None = None  # the tasks evaluated during training: their latest figures; the plots
    plots: list[str] = field(default_factory=list)  # eval_tasks.png: the tasks over the run's steps


@dataclass
class Report:
    run_dir: Path
    title: str
    facts: list[tuple[str, str]]
    verdicts: list[Verdict]
    plots: dict[str, Path]
    markdown: Path | None = None
    html: Path | None = None
    evaluation: Evaluation | None = None  # eval.tasks results: during training, and `llmtrain eval`'s eval.json
    left_out: dict[str, str] = field(default_factory=dict)  # plot name -> the line that says why it was not drawn
    seconds: float | None = None  # the run's wall time (run_seconds), for report.console=auto


def logged(records: Records, kind: str) -> list[Record]:
    """Each record of a kind the monitor may write to both logs, once: events.jsonl's when it has
    any (the monitor's own log), else metrics.jsonl's (older runs, monitor off)."""
    return records.written(kind, EVENTS) or records.written(kind, METRICS)


def train_losses(records: Records) -> list[tuple[int, float]]:
    """(step, loss) of every logged train loss, finite ones, in step order: the train records (every
    log_interval) and the health checks (every monitor.interval), one step's loss, not an average,
    so a spike shows as it was."""
    points = dict(zip(*records.series(Kind.HEALTH, "loss")))
    points.update(zip(*records.series(Kind.TRAIN, "loss")))
    return [(s, points[s]) for s in sorted(points) if math.isfinite(points[s])]


def steps_text(steps: list[Any]) -> str:
    shown = ", ".join(str(s) for s in steps[:5]) + (", ..." if len(steps) > 5 else "")
    return f"step {shown}" if len(steps) == 1 else f"steps {shown}"
