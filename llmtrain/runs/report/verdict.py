"""What a report is made of: a question's `Verdict`, the Evaluation section, the `Report`, the
statuses, and the record helpers the questions share."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmtrain.core.files import (
    EVENTS,
    METRICS,
)
from llmtrain.runs.records import Record, Records

OK, WARN, FAIL, NA = "ok", "warn", "fail", "n/a"


@dataclass
class Verdict:
    key: str
    question: str
    status: str
    finding: str
    details: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)  # PNG names under report/
    marks: list[int] = field(default_factory=list)  # steps to mark on its plot (the spikes)


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



def steps_text(steps: list[Any]) -> str:
    shown = ", ".join(str(s) for s in steps[:5]) + (", ..." if len(steps) > 5 else "")
    return f"step {shown}" if len(steps) == 1 else f"steps {shown}"
