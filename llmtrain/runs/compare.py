"""`llmtrain compare <sweep dir>`: the runs of a sweep side by side.

Every run dir under the sweep dir (a folder with a `metrics.jsonl`, e.g. Hydra's
`multirun/<date>/<time>/<job>/`) becomes one row: the overrides that differ between the runs, the
final train and validation loss, the best validation loss and its step, the health alarms raised,
the median tokens/s and whether the run finished. Rows are sorted by final validation loss (runs
without one last). The table goes to the terminal, `compare.csv` and a PNG of the loss curves next
to it; runs too short for curves (at most 2 logged losses each) get no PNG, and the line that says
why and which log_interval gives curves.

A run's row comes from its metrics.jsonl as written (runs/records.py's `written` view): a record of
a step that a resume took again drops the first take's later points from the curve. `summarize` is
also the CLI's summary of a finished run and the report's facts (status, steps, losses).
"""

from __future__ import annotations

import csv
import math
import statistics
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from llmtrain.errors import UserError
from llmtrain.runs.files import CHECKPOINTS, CONFIG, FINAL_WEIGHTS, METRICS, Kind
from llmtrain.runs.leftout import denser, enough
from llmtrain.runs.records import Records, number, read_records
from llmtrain.runs.rundir import HYDRA_SUBDIR


@dataclass
class RunSummary:
    run_dir: Path
    overrides: list[str]
    final_train_loss: float | None = None
    final_val_loss: float | None = None
    best_val_loss: float | None = None
    best_step: int | None = None
    alarms: list[str] = field(default_factory=list)
    tokens_per_s: float | None = None
    steps: int = 0
    planned_steps: int | None = None
    finished: bool = False
    train_curve: list[tuple[int, float]] = field(default_factory=list)
    val_curve: list[tuple[int, float]] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.finished:
            return "finished"
        return f"stopped at {self.steps}" + (f"/{self.planned_steps}" if self.planned_steps else "")


def find_runs(sweep_dir: Path) -> list[Path]:
    """Run dirs under `sweep_dir` (itself included), in path order."""
    if not sweep_dir.is_dir():
        raise UserError(f"'{sweep_dir}' is not a folder; give a sweep dir, e.g. multirun/2026-11-29/12-00-00.")
    runs = sorted({p.parent for p in sweep_dir.rglob(METRICS) if CHECKPOINTS not in p.parts})
    if not runs:
        raise UserError(f"'{sweep_dir}' holds no run (no metrics.jsonl below it); give the folder a sweep "
                        "(`llmtrain train -m ...`) or a run wrote into.")
    return runs


def summarize(run_dir: Path, records: Records | None = None) -> RunSummary:
    """One run's row, from its records (read from `run_dir` unless given) and its overrides."""
    overrides_file = run_dir / HYDRA_SUBDIR / "overrides.yaml"
    overrides: list[str] = []
    if overrides_file.is_file():
        overrides = [str(o) for o in yaml.safe_load(overrides_file.read_text()) or []]
    records = records if records is not None else read_records(run_dir)
    summary = RunSummary(run_dir, overrides)
    # The last step taken (train records come every log_interval only).
    summary.steps = max([0, *(int(r.get("step", 0)) for kind in (Kind.TRAIN, Kind.EVAL, Kind.CHECKPOINT)
                              for r in records.written(kind))])
    starts = records.written(Kind.START)
    if starts:  # the last start (a resume's) plans the run
        summary.planned_steps = starts[-1].get("steps")
    speeds = []
    for record in records.written(Kind.TRAIN):
        summary.train_curve = [(s, v) for s, v in summary.train_curve if s < record["step"]]  # a resume redoes steps
        summary.train_curve.append((record["step"], number(record["loss"])))
        if record.get("tokens_per_s"):
            speeds.append(number(record["tokens_per_s"]))
    for record in records.written(Kind.EVAL):
        summary.val_curve = [(s, v) for s, v in summary.val_curve if s < record["step"]]
        summary.val_curve.append((record["step"], number(record["val_loss"])))
    for record in records.written(Kind.ALARM):
        if record.get("alarm") not in summary.alarms:
            summary.alarms.append(record["alarm"])
    if summary.train_curve:
        summary.final_train_loss = summary.train_curve[-1][1]
    finite_val = [(s, v) for s, v in summary.val_curve if math.isfinite(v)]
    if summary.val_curve:
        summary.final_val_loss = summary.val_curve[-1][1]
    if finite_val:
        summary.best_step, summary.best_val_loss = min(finite_val, key=lambda sv: sv[1])
    summary.tokens_per_s = statistics.median(speeds) if speeds else None
    summary.finished = (run_dir / FINAL_WEIGHTS).is_file() and (
        summary.planned_steps is None or summary.steps >= summary.planned_steps)
    return summary


def _sort_key(summary: RunSummary) -> tuple:
    val = summary.final_val_loss
    train = summary.final_train_loss
    return (val is None or not math.isfinite(val), val if val is not None else 0.0,
            train is None or not math.isfinite(train), train if train is not None else 0.0)


def compare_runs(sweep_dir: Path) -> tuple[list[RunSummary], list[str]]:
    """The runs, best first, and the overrides they all share (shown once, not per row)."""
    summaries = sorted((summarize(run) for run in find_runs(sweep_dir)), key=_sort_key)
    common = [o for o in summaries[0].overrides if all(o in s.overrides for s in summaries)]
    for s in summaries:
        s.overrides = [o for o in s.overrides if o not in common]
    return summaries, common


COLUMNS = ("run", "overrides", "final train loss", "final val loss", "best val loss", "best step", "alarms",
           "tokens/s", "status")


def rows(summaries: list[RunSummary], sweep_dir: Path) -> list[list[str]]:
    def fmt(value: float | None, digits: int = 4) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    return [[str(s.run_dir.relative_to(sweep_dir)) if s.run_dir != sweep_dir else ".", " ".join(s.overrides) or "-",
             fmt(s.final_train_loss), fmt(s.final_val_loss), fmt(s.best_val_loss),
             "-" if s.best_step is None else str(s.best_step), ", ".join(s.alarms) or "-",
             "-" if s.tokens_per_s is None else f"{s.tokens_per_s:,.0f}", s.status] for s in summaries]


def write_csv(summaries: list[RunSummary], sweep_dir: Path, path: Path) -> None:
    """The same rows with plain numbers (empty where there is none), for a spreadsheet or pandas."""
    def plain(value: object) -> object:
        return "" if value is None else value

    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["run", "overrides", "final_train_loss", "final_val_loss", "best_val_loss", "best_step", "alarms",
                         "tokens_per_s", "status", "run_dir"])
        for s, row in zip(summaries, rows(summaries, sweep_dir)):
            writer.writerow([row[0], " ".join(s.overrides), plain(s.final_train_loss), plain(s.final_val_loss),
                             plain(s.best_val_loss), plain(s.best_step), " ".join(s.alarms), plain(s.tokens_per_s),
                             s.status, str(s.run_dir)])


def plot_curves(summaries: list[RunSummary], path: Path, title: str) -> str | None:
    """Train loss (lines) and validation loss (dashed, dots) against step, one colour per run.
    Returns None when written; when no run has a curve of CURVE_MIN_POINTS points, writes nothing
    (and removes an older PNG at `path`) and returns the line that says why."""
    longest = max((max(len(s.train_curve), len(s.val_curve)) for s in summaries), default=0)
    if not enough(longest):
        path.unlink(missing_ok=True)
        return too_few_text(summaries, path.name, longest)
    import matplotlib  # here, not at the top: only the PNG needs it, and it is slow to import

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    for index, s in enumerate(summaries):
        colour = f"C{index % 10}"
        label = " ".join(s.overrides) or s.run_dir.name
        if s.train_curve:
            steps, values = zip(*s.train_curve)
            ax.plot(steps, values, color=colour, linewidth=1.2, alpha=0.8, label=f"{label} (train)")
        if s.val_curve:
            steps, values = zip(*s.val_curve)
            ax.plot(steps, values, color=colour, linestyle="--", marker="o", markersize=3, label=f"{label} (val)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("\n".join(textwrap.wrap(title, 130)), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def too_few_text(summaries: list[RunSummary], name: str, longest: int) -> str:
    """'compare.png: left out: at most 2 logged losses per run (log_interval=10; runs of 20 steps):
    too few for curves; log_interval=4 gives 5', from the runs' config.yaml."""
    intervals = sorted({i for i in map(_log_interval, summaries) if i is not None})
    steps = min(s.steps for s in summaries)
    text = (f"{name}: left out: {'no logged losses' if longest == 0 else f'at most {longest} logged losses per run'} "
            f"({'log_interval=' + '/'.join(map(str, intervals)) + '; ' if intervals else ''}"
            f"{'runs of ' if len(summaries) > 1 else 'a run of '}{steps}"
            f"{'+' if any(s.steps > steps for s in summaries) else ''} steps)")
    return text + (": too few for curves" if longest else "") + (denser("log_interval", min(intervals), steps)
                                                                    if intervals else "")


def _log_interval(summary: RunSummary) -> int | None:
    """The run's log_interval, from its config.yaml (None when it cannot be read)."""
    try:
        value = (yaml.safe_load((summary.run_dir / CONFIG).read_text()) or {}).get("log_interval")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
