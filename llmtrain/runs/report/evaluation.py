"""The Evaluation section: the evaluation tasks' results, from `llmtrain eval`'s eval.json and
the eval.tasks evaluated during training (their figure, eval_tasks.png, is plots.py's). Information,
not a question: no verdict."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmtrain.core.files import (
    EVAL_RESULTS,
    Kind,
)
from llmtrain.metrics.text import TASK_HEADLINE, is_number, scored_text, task_metrics_text
from llmtrain.runs.records import Record, Records, number
from llmtrain.runs.report.verdict import Evaluation

# ---------------------------------------------------------------------------------------------
# evaluation tasks
# ---------------------------------------------------------------------------------------------

TaskPoints = dict[str, list[Record]]  # task entry -> its eval_task records, one per step, in step order


def eval_task_points(records: Records) -> TaskPoints:
    """The eval_task records per task, the last take of each step (a resume redoes the steps after
    its checkpoint), in step order; tasks in the order first evaluated."""
    by_task: dict[str, dict[int, Record]] = {}
    for record in records.of(Kind.EVAL_TASK):
        if record.get("task") is not None and record.get("step") is not None:
            by_task.setdefault(str(record["task"]), {})[int(record["step"])] = record
    return {task: [steps[s] for s in sorted(steps)] for task, steps in by_task.items()}


def evaluation(run_dir: Path, points: TaskPoints, plots: list[str]) -> Evaluation | None:
    """The Evaluation section: eval.json's results (`llmtrain eval`) when the run dir has one, and
    the tasks evaluated during training; None when there is neither."""
    saved = _eval_results(run_dir / EVAL_RESULTS)
    if saved is None and not points:
        return None
    section, summary = Evaluation(""), []
    if isinstance(saved, str):  # unreadable
        section.saved = saved
        summary.append(saved)
    elif saved is not None:
        # only this run's entries: `llmtrain eval OTHER --out RUN_DIR` may have added another model's
        own = str(run_dir.resolve())
        saved["tasks"] = {t: m for t, m in saved["tasks"].items() if m.get("model") in (None, own)}
        section.rows = [(task, str(m.get("kind", "?")), _metrics_cell(m), scored_text(m))
                        for task, m in saved["tasks"].items()]
        when = saved.get("updated") or saved.get("created")
        section.saved = (f"{EVAL_RESULTS} (`llmtrain eval`): {len(section.rows)} task(s)"
                         + (f" of {saved['model']}" if saved.get("model") else "")
                         + (f", written {when}" if when else "") + ".")
        summary.append(f"{EVAL_RESULTS}: " + "; ".join(f"{task} {task_metrics_text(m, ', ')}".rstrip()
                                                        for task, m in saved["tasks"].items()))
    if points:
        # each task at its own last step (a resume may have dropped a task that ran before)
        latest = "; ".join(f"{task} at step {records[-1]['step']}: {task_metrics_text(records[-1], ', ')}".rstrip()
                           for task, records in points.items())
        section.training = f"During training (eval.tasks, at every evaluation): {len(points)} task(s); {latest}."
        section.plots = plots
        summary.append(f"during training: {latest}")
    section.summary = " | ".join(summary)
    return section


def _eval_results(path: Path) -> dict | str | None:
    """eval.json as a dict with a "tasks" dict; a sentence when it cannot be read; None without one."""
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return f"{path.name} could not be read ({type(err).__name__}: {str(err)[:200]})."
    if not isinstance(document, dict) or not isinstance(document.get("tasks"), dict):
        return f"{path.name} has no \"tasks\" object: not a file `llmtrain eval` wrote."
    document["tasks"] = {str(k): v for k, v in document["tasks"].items() if isinstance(v, dict)}
    return document


def _metrics_cell(metrics: dict[str, Any]) -> str:
    """The headline metrics, each with its standard error when the task gave one; a harness task's
    own metrics when it has none of them."""
    parts = [f"{label} {fmt.format(number(metrics[key]))}"
             + (f" ± {number(metrics[key + '_stderr']):.4f}" if is_number(metrics.get(key + "_stderr")) else "")
             for key, label, fmt in TASK_HEADLINE if is_number(metrics.get(key))]
    return ", ".join(parts) if parts else task_metrics_text(metrics, ", ")
