"""`llmtrain report <run dir>`: the post-run review of one run, with plots.

Seven questions, each answered with a verdict (ok / warn / fail / n/a) and the numbers behind it:

    learning      did the loss fall, and below the unigram baseline (the loss of a model that
                  ignores context)? From the final loss, its distance to the first one and the trend
    smoothness    spikes in the train loss (robust z-score against the preceding window, and a rise
                  large in nats and in share: a flat curve is flat)
    overfitting   the validation-train gap over time, and where validation turns up if it does
    inference     the final weights reloaded: eval mode twice identical, equal to train mode with
                  dropout off (engine/modes.py's probe), a few sampled tokens
    memory        peak memory against what the device has
    step time     data / forward / backward / optimizer / other on the timed steps, the
                  bottleneck, tokens/s and MFU
    alarms        the health alarms raised (with their most likely cause when the record ranks
                  causes) and the actions taken, non-finite steps, failed saves

The section over the health plots carries the monitor's verdict too (ok only without alarms), and
the loss plot draws the unigram baseline and marks the steps where alarms fired. An Evaluation
section (information, no verdict) lists the evaluation tasks' results: `llmtrain eval`'s eval.json
in the run dir, and the eval.tasks evaluated during training (eval_tasks.png: one panel per task).

The shape is the pre-flight check's: `QUESTIONS` below is the registry (the check's ITEMS), one
module per question, each a function from the run's records to a `Verdict`, a Finding
(core/findings.py) with the plots under it (verdict.py): learning.py, smoothness.py,
overfitting.py, inference.py, memory.py, step_time.py, alarms.py; health.py holds the health
section's verdict, evaluation.py the Evaluation section, plots.py the figures (one function each),
render.py the written forms through the findings renderers. This module reads the run and puts the
report together (`build_report`, `write_report`).

Everything comes from the run dir, so a run that was interrupted or crashed gets its report too:
the logs through runs/records.py (the run as it finally went: a resume's redone steps replace the
first take), the headline facts from compare's `summarize`, the weights through runs/artifacts.py,
config.yaml and tokenizer.json. Writes report/*.png, report.md (which links the PNGs) and
report.html (self-contained: the PNGs are inside it).

torch, matplotlib, the model and the data are imported inside the functions that need them, so
`llmtrain report --no-inference` never loads torch.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmtrain.config.saved import read_saved
from llmtrain.config.schema import DataSource
from llmtrain.core.atomic import write_atomically
from llmtrain.core.errors import UserError
from llmtrain.core.files import CONFIG, METRICS, REPORT_HTML, REPORT_MD, TRAINER_STATE, Kind
from llmtrain.metrics.text import is_number
from llmtrain.preflight.parameters import ParameterCounts
from llmtrain.runs.compare import recorded_overrides, summarize
from llmtrain.runs.leftout import Reasons
from llmtrain.runs.records import Record, Records, read_records

# The question modules by name (not their functions: a package attribute that is a function would
# hide the submodule of that name from `import llmtrain.runs.report.memory`).
from llmtrain.runs.report import (
    alarms,
    inference,
    learning,
    memory,
    overfitting,
    smoothness,
    step_time,
)
from llmtrain.runs.report.evaluation import eval_task_points, evaluation
from llmtrain.runs.report.health import HEALTH_PLOTS, health_quantities
from llmtrain.runs.report.plots import draw_eval_tasks, draw_plots
from llmtrain.runs.report.render import to_html, to_markdown
from llmtrain.runs.report.verdict import Report, RunEvidence, Verdict

# The questions, in the order the report asks them: each a function of the run (the check's ITEMS).
QUESTIONS: list[Callable[[RunEvidence], Verdict]] = [
    lambda run: learning.learning(run.records, run.baseline),
    lambda run: smoothness.smoothness(run.records, run.spike_z),
    lambda run: overfitting.overfitting(run.records),
    lambda run: inference.inference(run.run_dir, run.cfg) if run.inference else inference.skipped(),
    lambda run: memory.memory(run.records),
    lambda run: step_time.step_time(run.records),
    lambda run: alarms.alarms(run.records),
]

# ---------------------------------------------------------------------------------------------
# reading the run
# ---------------------------------------------------------------------------------------------


def unigram_baseline(records: Records, cfg: Any) -> float | None:
    """The loss to beat, the unigram entropy of the train split (nats/token): from the start record
    when it carries it, else from the prepared data's meta in the cache (never prepared here);
    None when neither has it."""
    start = records.last(Kind.START) or {}
    for key in ("unigram_entropy", "unigram_entropy_nats"):
        if _positive(start.get(key)):
            return float(start[key])
    if cfg is None:
        return None
    from llmtrain.data.cache import cached_meta

    try:
        meta = cached_meta(cfg.data) or {}
    except Exception:  # noqa: BLE001 - a moved corpus, an unloadable dataset: no baseline, the rest stands
        return None
    return float(meta["unigram_entropy_nats"]) if _positive(meta.get("unigram_entropy_nats")) else None


def _positive(value: Any) -> bool:
    try:
        return value is not None and math.isfinite(float(value)) and float(value) > 0
    except (TypeError, ValueError):
        return False


def _load_config(run_dir: Path) -> Any:
    """The run's config (read within bounds: config/saved.py); None when it is missing or unusable."""
    path = run_dir / CONFIG
    if not os.path.lexists(path):
        return None
    try:
        return read_saved(path)
    except UserError:
        return None


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------


def build_report(run_dir: Path, inference_check: bool = True) -> Report:
    """Answer the seven questions and draw the plots (into RUN_DIR/report/); `write_report` also
    writes the two pages. Raises UserError for a folder that is not a run dir."""
    run_dir = Path(run_dir)
    if not (run_dir / METRICS).is_file():
        raise UserError(f"'{run_dir}' has no metrics.jsonl: give a run dir that `llmtrain train` wrote "
                        "(its banner prints it, e.g. outputs/<date>/<time>).")
    records = read_records(run_dir)
    cfg = _load_config(run_dir)
    baseline = unigram_baseline(records, cfg)
    summary = summarize(run_dir, records)
    run = RunEvidence(run_dir, records, cfg, baseline, inference_check)
    verdicts = [ask(run) for ask in QUESTIONS]
    start = records.last(Kind.START) or {}
    reasons = Reasons(cfg, summary.steps, summary.planned_steps)
    marks = [step for verdict in verdicts for step in verdict.marks]  # the spikes
    plots, left_out = draw_plots(records, run_dir / "report", marks, baseline, reasons)
    facts = [
        ("run dir", str(run_dir)),
        ("status", summary.status),
        *run_description(cfg, start, recorded_overrides(run_dir)),
        ("steps", f"{summary.steps:,}" + (f" of {summary.planned_steps:,}" if summary.planned_steps else "")),
        ("tokens", tokens_text(records, run_dir, summary.steps)),
        ("final train loss", f"{summary.final_train_loss:.4f}" if summary.final_train_loss is not None else "-"),
        ("final val loss", f"{summary.final_val_loss:.4f}" if summary.final_val_loss is not None else "-"),
        ("best val loss", f"{summary.best_val_loss:.4f} (step {summary.best_step})"
         if summary.best_val_loss is not None else "-"),
        ("unigram baseline", f"{baseline:.4f} nats/token (the loss of a model that ignores context)"
         if baseline is not None else "- (not recorded, and the run's data is not in the cache)"),
        ("device", f"{start.get('device', '?')}, {start.get('precision', '?')}, "
                   f"world size {start.get('world_size', 1)}"),
    ]
    # A plot left out keeps its place in its section, which says why it is not there.
    for verdict in verdicts:
        verdict.plots = [p for p in verdict.plots if p in plots or p in left_out]
    verdicts.append(health_quantities(records, HEALTH_PLOTS))
    task_points = eval_task_points(records)
    if task_points:
        drawn, missing = draw_eval_tasks(task_points, run_dir / "report", reasons)
        plots.update(drawn)
        left_out.update(missing)
    return Report(run_dir, f"Run report: {run_dir.name}", facts, verdicts, plots,
                  evaluation=evaluation(run_dir, task_points, ["eval_tasks.png"] if task_points else []),
                  left_out=left_out, seconds=run_seconds(records))


def run_description(cfg: Any, start: Record, overrides: list[str] | None) -> list[tuple[str, str]]:
    """The header's model (name, shape, parameter counts as the banner shows them), data (source,
    tokenizer, the model's vocabulary) and the command-line overrides that made the run."""
    counts = ParameterCounts.from_record(start.get("parameters"))
    parameters = (f"parameters {counts.text()}" if counts is not None
                  else "parameter counts not recorded (a run from before the start record kept them)")
    if cfg is None:
        model = data = "- (config.yaml is missing or unreadable)"
    else:
        m, d = cfg.model, cfg.data
        model = (f"{m.name}: {m.n_layer} layer{'s' if m.n_layer != 1 else ''} x {m.n_embd} wide, {m.n_head} "
                 f"head{'s' if m.n_head != 1 else ''}, context {m.block_size}")
        where = {DataSource.python_stdlib: "this Python's standard library sources",
                 DataSource.hf: " ".join(str(part) for part in (d.hf_name, d.hf_config) if part)}.get(d.source, d.path)
        vocab = start.get("vocab_size")
        data = (f"{d.source.value}{f' ({where})' if where else ''}, {d.tokenizer.value} tokens"
                + (f", model vocabulary {int(vocab):,}" if is_number(vocab) else ""))
    if overrides is None:
        given = "not recorded (a run started from Python, not from the command line)"
    else:
        given = " ".join(overrides) if overrides else "none (the defaults)"
    return [("model", f"{model}; {parameters}"), ("data", data), ("overrides", given)]


def write_report(run_dir: Path, inference: bool = True) -> Report:
    """Build the report and write report.md and report.html into the run dir."""
    try:
        report = build_report(run_dir, inference)
        report.markdown = report.run_dir / REPORT_MD
        report.html = report.run_dir / REPORT_HTML
        for path, text in ((report.markdown, to_markdown(report)), (report.html, to_html(report))):
            write_atomically(path, lambda fh, text=text: fh.write(text.encode("utf-8")))
    except OSError as err:  # a read-only run dir, a full disk
        raise UserError(f"the report for '{run_dir}' could not be written: {err}. Give a run dir you can write to, "
                        "or copy it somewhere writable first.") from None
    return report


def tokens_text(records: Records, run_dir: Path, steps: int) -> str:
    """The tokens trained on up to the run's last step, the figure a resume from that step prints.
    The last train record is not it when log_interval left the last steps unlogged (a stop at step 49
    logged at 40): the end record (it carries tokens) or that step's checkpoint says it; failing both,
    the last logged figure, said to be that."""
    for record in reversed(records.of(Kind.END)):
        if record.get("tokens") is not None and int(record.get("step", -1)) == steps:
            return f"{int(record['tokens']):,}"
    from llmtrain.checkpoint.layout import checkpoint_root, step_dir_name

    try:
        trainer = json.loads((checkpoint_root(run_dir) / step_dir_name(steps) / TRAINER_STATE).read_text())
        return f"{int(trainer['state']['tokens']):,}"
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no readable checkpoint of that step
    last = records.last(Kind.TRAIN) or {}
    tokens = int(last.get("tokens", 0))
    if last and int(last["step"]) < steps:
        return f"{tokens:,} by step {last['step']}, the last logged one"
    return f"{tokens:,}"


def run_seconds(records: Records) -> float | None:
    """The run's wall time in seconds: the last train record's elapsed_s (from the loop's start in
    the process that took the last steps, so a resume counts from its own start); None without one."""
    last = records.last(Kind.TRAIN) or {}
    seconds = last.get("elapsed_s")
    return float(seconds) if is_number(seconds) else None

