"""Running evaluation tasks on a trained model and keeping what they found (`llmtrain eval`): a
progress bar per task, the results table, and eval.json in the run dir (or --out).

eval.json holds the latest result of every task ever evaluated into that folder: evaluating other
tasks later adds to it, evaluating a task again replaces that task's entry (each entry says when it
was made). One that cannot be read is moved aside under a name of its own, never overwritten. The
lm-evaluation-harness's own results go beside it, as harness-TASK.json, in the form the harness
writes them.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from llmtrain.core.atomic import write_atomically
from llmtrain.core.console import is_plain
from llmtrain.core.errors import UserError
from llmtrain.core.files import EVAL_RESULTS
from llmtrain.core.readers import MB, UnreadableFile, read_json
from llmtrain.evaluation.scoring import Scorer
from llmtrain.evaluation.tasks import Task
from llmtrain.metrics.text import scored_text

# The table's columns: (metric key, heading, format); other metrics of a task go into "other".
COLUMNS = (("loss", "loss", "{:.4f}"), ("perplexity", "perplexity", "{:.3f}"), ("bits_per_byte", "bits/byte", "{:.4f}"),
           ("acc", "acc", "{:.4f}"), ("acc_norm", "acc_norm", "{:.4f}"))
COUNTS = ("tokens", "examples", "documents", "bytes")  # how much was scored: shown as one "scored" cell
# eval.json is ~300 bytes per task entry: a bigger one is not results, and is moved aside unread.
RESULTS_BYTES = 64 * MB


def run_tasks(tasks: Sequence[Task], scorer: Scorer, console: Console) -> dict[str, dict[str, Any]]:
    """Every task's metrics (plus its kind and the seconds it took), keyed by the task's entry."""
    results: dict[str, dict[str, Any]] = {}
    for task in tasks:
        started = time.perf_counter()
        with _progress(console, task) as advance:
            metrics = task.run(scorer, advance)
        results[task.spec.name] = {"kind": task.spec.kind, **metrics,
                                   "seconds": round(time.perf_counter() - started, 2)}
    return results


class _progress:
    """A progress bar over the task's requests on a terminal; one line per task otherwise."""

    def __init__(self, console: Console, task: Task) -> None:
        self.console, self.task, self.bar = console, task, None

    def __enter__(self) -> Any:
        if is_plain(self.console) or not self.console.is_terminal:
            self.console.print(f"evaluating {self.task.spec.name}"
                               + (f" ({self.task.size:,} request{'s' if self.task.size != 1 else ''})"
                                  if self.task.size else ""))
            return None
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TimeRemainingColumn(), console=self.console, transient=True)
        self.bar.start()
        handle = self.bar.add_task(self.task.spec.name, total=self.task.size or None)
        return lambda n: self.bar.advance(handle, n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def render_results(results: dict[str, dict[str, Any]], console: Console) -> None:
    """The results as a table (plain lines when the output is piped)."""
    columns = [c for c in COLUMNS if any(c[0] in m for m in results.values())]
    rows = []
    for name, metrics in results.items():
        cells = [_cell(metrics.get(key), fmt) for key, _, fmt in columns]
        rows.append((name, cells, scored_text(metrics, COUNTS, at_most=2), _other(metrics, {c[0] for c in columns})))
    if is_plain(console):
        for name, cells, scored, other in rows:
            parts = [f"{heading} {cell}" for (_, heading, _), cell in zip(columns, cells) if cell]
            console.print(f"{name}: " + ", ".join(p for p in [*parts, other, scored] if p), highlight=False)
        return
    with_other = any(other for *_, other in rows)
    table = Table(show_edge=False, header_style="bold")
    for heading in ("task", *(c[1] for c in columns), *(["other"] if with_other else []), "scored"):
        table.add_column(heading, justify="left" if heading in ("task", "other") else "right")
    for name, cells, scored, other in rows:
        table.add_row(name, *cells, *([other] if with_other else []), scored)
    console.print(table)


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return ""
    return fmt.format(value) if isinstance(value, (int, float)) and math.isfinite(value) else str(value)


def _other(metrics: dict[str, Any], shown: set[str]) -> str:
    """Numeric metrics without a column (a harness task's own), stderr left out."""
    skip = shown | set(COUNTS) | {"kind", "seconds", "evaluated_at", "model"}
    return ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v:,}" for k, v in metrics.items()
                     if k not in skip and "stderr" not in k and isinstance(v, (int, float)) and not isinstance(v, bool))


def write_results(out_dir: Path, results: dict[str, dict[str, Any]], about: dict[str, Any],
                  harness: dict[str, dict] | None = None, warn: Callable[[str], None] | None = None) -> Path:
    """Merge `results` into OUT_DIR/eval.json (written whole or not at all) and write each harness
    task's own results as OUT_DIR/harness-TASK.json; returns eval.json's path. An eval.json that
    cannot be read is moved aside, never overwritten (eval.json.unreadable, then .unreadable.1, .2,
    ...), and `warn` says where it went."""
    warn = warn or (lambda message: print(f"llmtrain: warning: {message}", file=sys.stderr))
    path = out_dir / EVAL_RESULTS
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        tasks = _previous_tasks(path, warn)
        for name, metrics in results.items():
            # each entry names its model: a folder of results may gather several models' entries
            tasks[name] = {**metrics, "model": about.get("model"), "evaluated_at": now}
        document = {**about, "updated": now, "tasks": tasks}
        write_atomically(path, json.dumps(document, indent=2, default=str) + "\n")
        for name, raw in (harness or {}).items():
            target = out_dir / f"harness-{_file_part(name)}.json"
            write_atomically(target, json.dumps(raw, indent=2, default=str) + "\n")
    except OSError as err:
        raise UserError(f"the results could not be written into '{out_dir}' ({err.strerror or err}); the evaluation "
                        "itself is printed above. Free space or give --out another folder, and run it again.") from None
    return path


def _previous_tasks(path: Path, warn: Callable[[str], None]) -> dict[str, Any]:
    """The tasks of the eval.json at `path`, read within bounds (it could be anything: a FIFO is
    never opened); {} when there is none, or when it cannot be read and has been moved aside."""
    if not os.path.lexists(path):
        return {}
    try:
        # allow_nan: a diverged model's perplexity is written as Infinity
        document = read_json(path, "the evaluation results", RESULTS_BYTES, allow_nan=True)
        tasks = document.get("tasks") if isinstance(document, dict) else None
        if isinstance(tasks, dict):
            return tasks
        why = f'{path} is JSON but not evaluation results (it has no "tasks" object).'
    except UnreadableFile as err:
        why = str(err)
    names = itertools.chain([path.name + ".unreadable"], (f"{path.name}.unreadable.{n}" for n in itertools.count(1)))
    kept = next(path.with_name(name) for name in names if not os.path.lexists(path.with_name(name)))
    path.rename(kept)  # kept for the user: an earlier one is never replaced
    warn(f"{why} It is kept as {kept.name}, and a new {path.name} is started.")
    return {}


def _file_part(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name.split(":", 1)[-1]).strip("._") or "task"
