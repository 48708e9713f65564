"""`llmtrain compare <sweep dir>`: the runs of a sweep side by side.

Every run dir under the sweep dir (a folder with a `metrics.jsonl`, e.g. Hydra's
`multirun/<date>/<time>/<job>/`) becomes one row: the overrides that differ between the runs, the
final train and validation loss, the best validation loss and its step, the health alarms raised,
the median tokens/s and whether the run finished. Rows are sorted by final validation loss (runs
without one last): nats per token, which compare only between runs of one tokenizer. When the runs'
tokenizers differ (another kind, or the same kind fitted to other data: tokenizer.json tells), they
are sorted by the bits per byte of an evaluation task they were scored on (eval.tasks during
training, or `llmtrain eval`'s eval.json), and a note under the table says so; without such a score
the note says that neither the losses nor their order compare. The table goes to the terminal,
`compare.csv` and a PNG of the loss curves next to it; runs too short for curves (at most 2 logged
losses each) get no PNG, and the line that says why and which log_interval gives curves.

A run's row comes from its metrics.jsonl as written (runs/records.py's `written` view): a record of
a step that a resume took again drops the first take's later points from the curve. `summarize` is
also the CLI's summary of a finished run and the report's facts (status, steps, losses).
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import statistics
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from llmtrain.core.atomic import write_atomically
from llmtrain.core.errors import UserError
from llmtrain.core.files import CHECKPOINTS, CONFIG, EVAL_RESULTS, FINAL_WEIGHTS, HYDRA_SUBDIR, METRICS, TOKENIZER, Kind
from llmtrain.core.readers import TOKENIZER_BYTES, UnreadableFile, read_bytes, read_json, read_yaml
from llmtrain.runs.leftout import denser, enough
from llmtrain.runs.records import Records, number, read_records


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
    tokenizer: str | None = None  # its kind (data.tokenizer in config.yaml); None when unknown
    tokenizer_id: str | None = None  # a digest of tokenizer.json: one kind fitted to other data is another tokenizer
    bits_per_byte: dict[str, float] = field(default_factory=dict)  # evaluation task -> its latest bits per byte

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


def recorded_overrides(run_dir: Path) -> list[str] | None:
    """The command-line overrides that made the run (Hydra's record of the job); None when there is
    no record (a run started from Python, not from the command line)."""
    try:
        saved = read_yaml(run_dir / HYDRA_SUBDIR / "overrides.yaml", "Hydra's record of the run's overrides")
    except UnreadableFile:  # none (or none readable): nothing to show, the run itself is fine
        return None
    if saved is None:  # an empty file: no overrides
        return []
    return [str(o) for o in saved] if isinstance(saved, list) else None


def summarize(run_dir: Path, records: Records | None = None) -> RunSummary:
    """One run's row, from its records (read from `run_dir` unless given) and its overrides."""
    records = records if records is not None else read_records(run_dir)
    summary = RunSummary(run_dir, recorded_overrides(run_dir) or [])
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
    data = _run_config(run_dir).get("data")
    kind = data.get("tokenizer") if isinstance(data, dict) else None
    summary.tokenizer = str(kind) if kind is not None else None
    summary.tokenizer_id = _tokenizer_id(run_dir)
    summary.bits_per_byte = _bits_per_byte(run_dir, records)
    return summary


def _tokenizer_id(run_dir: Path) -> str | None:
    """A digest of the run's tokenizer.json (None without a readable one): equal for runs of one
    tokenizer, whatever its kind."""
    try:
        return hashlib.sha256(read_bytes(run_dir / TOKENIZER, "the run's tokenizer", TOKENIZER_BYTES)).hexdigest()
    except UnreadableFile:
        return None


def _bits_per_byte(run_dir: Path, records: Records) -> dict[str, float]:
    """Each evaluation task's latest bits per byte: the eval.tasks scored during training, then
    `llmtrain eval`'s eval.json (the final weights on all of the text) where it has the task."""
    found = {str(r["task"]): r.get("bits_per_byte") for r in records.of(Kind.EVAL_TASK) if r.get("task") is not None}
    try:
        saved = read_json(run_dir / EVAL_RESULTS, "the run's evaluation results")
    except UnreadableFile:  # none, or not one `llmtrain eval` wrote: the records alone
        saved = {}
    tasks = saved.get("tasks") if isinstance(saved, dict) else None
    own = str(run_dir.resolve())  # `llmtrain eval OTHER --out RUN_DIR` may have added another model's
    for task, metrics in (tasks.items() if isinstance(tasks, dict) else ()):
        if isinstance(metrics, dict) and metrics.get("model") in (None, own) and "bits_per_byte" in metrics:
            found[str(task)] = metrics["bits_per_byte"]
    return {task: bits for task, value in found.items() if (bits := _finite(value)) is not None}


def _finite(value: object) -> float | None:
    """A record's value as a finite number; None for anything else (missing, text, NaN)."""
    try:
        figure = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return figure if math.isfinite(figure) else None


@dataclass(frozen=True)
class Ranking:
    """What the runs are sorted by: the final validation loss, in nats per token; when their
    tokenizers differ, the bits per byte of `task` (the evaluation task most of them were scored
    on), which compares across tokenizers. `note` says why, under the table."""

    task: str | None = None
    note: str | None = None


def tokenizer_names(summaries: list[RunSummary]) -> dict[str | None, str]:
    """Each tokenizer (by digest) under its kind; a kind fitted to other data too gets the start of
    its digest ('char #1a2b3c4d')."""
    kinds = {s.tokenizer_id: s.tokenizer or "unknown" for s in summaries}
    shared = Counter(kinds.values())
    return {key: kind if shared[kind] == 1 or key is None else f"{kind} #{key[:8]}" for key, kind in kinds.items()}


def ranking(summaries: list[RunSummary]) -> Ranking:
    """How `summaries` compare (see Ranking)."""
    if len({s.tokenizer_id for s in summaries if s.tokenizer_id is not None}) <= 1:
        return Ranking()
    names = tokenizer_names(summaries)
    runs = Counter(names[s.tokenizer_id] for s in summaries)
    differ = ("the runs use different tokenizers (" + ", ".join(f"{name}: {n} run{'s' if n > 1 else ''}"
                                                               for name, n in runs.items())
              + "), so their losses, in nats per token of different tokens, do not compare")
    scored = Counter(task for s in summaries for task in s.bits_per_byte)
    if not scored:
        return Ranking(None, f"{differ}, nor does this order by validation loss. Bits per byte do: score each run with "
                             "`llmtrain eval RUN_DIR` (or train with eval.tasks=[perplexity:validation]), then compare "
                             "again.")
    task = max(scored, key=lambda t: scored[t])  # the task most runs were scored on (the first of equals)
    missing = len(summaries) - scored[task]
    return Ranking(task, f"{differ}: sorted by bits per byte on {task}, which do"
                         + (f"; the {missing} run{'s' if missing > 1 else ''} without that score come last, by "
                            "validation loss, and do not compare with the others" if missing else "") + ".")


def _loss_key(summary: RunSummary) -> tuple:
    val = summary.final_val_loss
    train = summary.final_train_loss
    return (val is None or not math.isfinite(val), val if val is not None else 0.0,
            train is None or not math.isfinite(train), train if train is not None else 0.0)


def _sort_key(summary: RunSummary, task: str | None) -> tuple:
    if task is None:
        return _loss_key(summary)
    bits = summary.bits_per_byte.get(task)
    return (bits is None, bits if bits is not None else 0.0, *_loss_key(summary))


def compare_runs(sweep_dir: Path) -> tuple[list[RunSummary], list[str]]:
    """The runs, best first (see `ranking`), and the overrides they all share (shown once, not per row)."""
    summaries = [summarize(run) for run in find_runs(sweep_dir)]
    task = ranking(summaries).task
    summaries.sort(key=lambda s: _sort_key(s, task))
    common = [o for o in summaries[0].overrides if all(o in s.overrides for s in summaries)]
    for s in summaries:
        s.overrides = [o for o in s.overrides if o not in common]
    return summaries, common


COLUMNS = ("run", "overrides", "final train loss", "final val loss", "best val loss", "best step", "alarms",
           "tokens/s", "status")


def columns(summaries: list[RunSummary]) -> list[str]:
    """COLUMNS, and where the runs' tokenizers differ, each run's tokenizer and the bits per byte
    they are sorted by (`rows` fills them)."""
    order = ranking(summaries)
    extra = (["tokenizer"] if order.note else []) + ([f"bits/byte ({order.task})"] if order.task else [])
    return [*COLUMNS[:6], *extra, *COLUMNS[6:]]


def rows(summaries: list[RunSummary], sweep_dir: Path) -> list[list[str]]:
    def fmt(value: float | None, digits: int = 4) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    order, names = ranking(summaries), tokenizer_names(summaries)
    return [[str(s.run_dir.relative_to(sweep_dir)) if s.run_dir != sweep_dir else ".", " ".join(s.overrides) or "-",
             fmt(s.final_train_loss), fmt(s.final_val_loss), fmt(s.best_val_loss),
             "-" if s.best_step is None else str(s.best_step),
             *([names[s.tokenizer_id]] if order.note else []),
             *([fmt(s.bits_per_byte.get(order.task))] if order.task else []),
             ", ".join(s.alarms) or "-", "-" if s.tokens_per_s is None else f"{s.tokens_per_s:,.0f}", s.status]
            for s in summaries]


def write_csv(summaries: list[RunSummary], sweep_dir: Path, path: Path) -> None:
    """The same rows with plain numbers (empty where there is none), for a spreadsheet or pandas; the
    tokenizer and the bits per byte the runs are sorted by (with its task) in every file."""
    def plain(value: object) -> object:
        return "" if value is None else value

    task, names = ranking(summaries).task, tokenizer_names(summaries)
    fh = io.StringIO(newline="")
    writer = csv.writer(fh)
    writer.writerow(["run", "overrides", "final_train_loss", "final_val_loss", "best_val_loss", "best_step", "alarms",
                     "tokens_per_s", "status", "run_dir", "tokenizer", "bits_per_byte", "bits_per_byte_task"])
    for s, row in zip(summaries, rows(summaries, sweep_dir)):
        writer.writerow([row[0], " ".join(s.overrides), plain(s.final_train_loss), plain(s.final_val_loss),
                         plain(s.best_val_loss), plain(s.best_step), " ".join(s.alarms), plain(s.tokens_per_s),
                         s.status, str(s.run_dir), names[s.tokenizer_id] if s.tokenizer else "",
                         plain(s.bits_per_byte.get(task) if task else None), plain(task)])
    write_atomically(path, fh.getvalue())


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
    ax.set_ylabel("loss (nats/token; not comparable across tokenizers)" if ranking(summaries).note
                  else "loss (nats/token)")
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
    value = _run_config(summary.run_dir).get("log_interval")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _run_config(run_dir: Path) -> dict:
    """The run's config.yaml as plain data; {} when it cannot be read."""
    try:
        config = read_yaml(run_dir / CONFIG, "the run's config")
    except UnreadableFile:
        return {}
    return config if isinstance(config, dict) else {}
