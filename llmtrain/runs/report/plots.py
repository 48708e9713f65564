"""The report's figures, one function per figure: the loss with its baseline, spikes and alarm marks,
the learning rate, the gradient norm, the parameter norm, the block activations, memory, throughput,
the time per step, and the evaluation tasks. Each returns the figure, or the one line that says why
there is nothing to show (runs/leftout.py); `draw_plots` saves the figures and removes the PNG of an
earlier report for each one left out. matplotlib is imported inside, so a report without plots
never loads it."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmtrain.core.files import Kind
from llmtrain.metrics.text import TASK_COUNTS, is_number
from llmtrain.runs.leftout import Reasons, enough
from llmtrain.runs.records import Record, Records, number
from llmtrain.runs.report.alarms import raised_alarms
from llmtrain.runs.report.evaluation import TaskPoints
from llmtrain.runs.report.step_time import PHASE_NAMES
from llmtrain.runs.report.verdict import logged, steps_text, train_losses

Drawn = Any  # a matplotlib Figure, or (a str) the line that says why the figure is left out


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _count(records: Records, kind: str, key: str) -> int:
    return len(records.series(kind, key)[0])


def _plot_series(ax: Any, series: tuple[list[int], list[float]], label: str) -> bool:
    """Draw one (steps, values) curve; False when there is nothing to draw."""
    if not series[0]:
        return False
    ax.plot(*series, label=label or None)
    return True


def _lines(records: Records, title: str, ylabel: str, curves: list[tuple[str, str, str]]) -> Drawn | None:
    """One plot of record fields against the step: (kind, key, legend label) per curve; None (nothing
    drawn) when no curve has enough points."""
    if not enough(*(_count(records, kind, key) for kind, key, _ in curves)):
        return None
    fig, ax = _pyplot().subplots(figsize=(8, 3))
    drawn = [label for kind, key, label in curves if _plot_series(ax, records.series(kind, key), label)]
    if any(drawn):  # named curves (memory's) get a legend
        ax.legend()
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    return fig


# ---------------------------------------------------------------------------------------------
# the figures
# ---------------------------------------------------------------------------------------------


def alarm_marks(records: Records) -> dict[str, list[int]]:
    """The steps the loss plot marks, per alarm name in the order first raised (any name the
    monitor writes), and the non-finite steps."""
    marks: dict[str, list[int]] = {}
    for alarm in raised_alarms(records):
        if alarm.get("step") is not None:
            marks.setdefault(str(alarm.get("alarm", "?")), []).append(int(alarm["step"]))
    nonfinite = [int(r["step"]) for r in logged(records, Kind.NONFINITE) if r.get("step") is not None]
    if nonfinite:
        marks["non-finite step"] = nonfinite
    return marks


def draw_loss(ax: Any, records: Records, spikes: list[int], baseline: float | None,
              marks: dict[str, list[int]]) -> None:
    """The loss plot: train and validation loss, the spikes, the unigram baseline (dashed) and a
    vertical line per alarm step, one colour and one legend entry per alarm name."""
    steps, losses = records.series(Kind.TRAIN, "loss")
    val_steps, val = records.series(Kind.EVAL, "val_loss")
    ax.plot(steps, losses, label="train", lw=1, color="C0")
    if val:
        ax.plot(val_steps, val, "o-", label="validation", ms=3, color="C1")
    spike_points = [(s, v) for s, v in train_losses(records) if s in spikes]  # health checks' losses too
    if spike_points:
        ax.plot(*zip(*spike_points), "rx", ms=8, label="spike")
    if baseline is not None:
        ax.axhline(baseline, ls="--", lw=1, color="grey", label=f"unigram baseline {baseline:.4f}")
    for i, (name, at) in enumerate(marks.items()):
        colour = f"C{(i + 2) % 10}"  # C0 and C1 are train and validation
        for j, step in enumerate(at):
            ax.axvline(step, ls=":", lw=1.2, color=colour, label=f"{name} ({steps_text(at)})" if j == 0 else None)
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="Loss")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def loss_figure(records: Records, reasons: Reasons, spikes: list[int], baseline: float | None) -> Drawn:
    train, val = _count(records, Kind.TRAIN, "loss"), _count(records, Kind.EVAL, "val_loss")
    if not enough(train, val):
        return reasons.logged("loss.png", train, "train loss", "train losses")
    fig, ax = _pyplot().subplots(figsize=(8, 4))
    draw_loss(ax, records, spikes, baseline, alarm_marks(records))
    return fig


def lr_figure(records: Records, reasons: Reasons) -> Drawn:
    sched = records.series(Kind.HEALTH, "lr_schedule")
    applied = _count(records, Kind.TRAIN, "lr")
    if not enough(applied, len(sched[0])):
        return reasons.logged("lr.png", applied, "learning rate")
    fig, ax = _pyplot().subplots(figsize=(8, 3))
    ax.plot(*records.series(Kind.TRAIN, "lr"), label="applied")
    if sched[0]:
        ax.plot(*sched, "--", label="schedule (health checks)")
    ax.set(xlabel="step", ylabel="learning rate", title="Learning rate")
    ax.legend()
    return fig


def grad_norm_figure(records: Records, reasons: Reasons) -> Drawn:
    g_steps, g = records.series(Kind.TRAIN, "grad_norm")
    finite = [(s, v) for s, v in zip(g_steps, g) if math.isfinite(v) and v > 0]
    if not enough(len(finite)):
        return reasons.logged("grad_norm.png", len(finite), "finite gradient norm")
    fig, ax = _pyplot().subplots(figsize=(8, 3))
    ax.semilogy(*zip(*finite), lw=1)
    ax.axhspan(0.1, 10, color="green", alpha=0.08, label="healthy band (0.1-10)")
    ax.legend()
    ax.set(xlabel="step", ylabel="gradient norm (pre-clip)", title="Gradient norm")
    return fig


def param_norm_figure(records: Records, reasons: Reasons) -> Drawn:
    fig = _lines(records, "Parameter norm", "parameter norm", [(Kind.HEALTH, "param_norm", "")])
    if fig is None:
        return reasons.monitored("param_norm.png", _count(records, Kind.HEALTH, "param_norm"), "parameter norm")
    return fig


def activations_figure(records: Records, reasons: Reasons) -> Drawn:
    samples = [r for r in records.of(Kind.HEALTH) if r.get("activation_mean")]
    if not enough(len(samples)):
        return reasons.activations("activations.png", [int(r["step"]) for r in samples])
    fig, (ax_mean, ax_var) = _pyplot().subplots(1, 2, figsize=(10, 3.5))
    blocks = len(samples[0]["activation_mean"])
    for b in range(blocks):
        steps_b = [r["step"] for r in samples]
        ax_mean.plot(steps_b, [number(r["activation_mean"][b]) for r in samples], label=f"block {b}")
        ax_var.plot(steps_b, [number(r["activation_var"][b]) for r in samples], label=f"block {b}")
    if blocks <= 12:
        ax_var.legend(fontsize=7)
    ax_mean.set(xlabel="step", ylabel="mean", title="Block output mean")
    ax_var.set(xlabel="step", ylabel="variance", title="Block output variance")
    return fig


def memory_figure(records: Records, reasons: Reasons) -> Drawn:
    curves = [(Kind.HEALTH, "rss_mb", "process RSS"), (Kind.HEALTH, "cuda_allocated_mb", "GPU allocated"),
              (Kind.HEALTH, "cuda_peak_mb", "GPU peak")]
    fig = _lines(records, "Memory", "MB", curves)
    if fig is None:
        return reasons.monitored("memory.png", max(_count(records, kind, key) for kind, key, _ in curves), "memory")
    return fig


def throughput_figure(records: Records, reasons: Reasons) -> Drawn:
    fig = _lines(records, "Throughput", "tokens/s", [(Kind.TRAIN, "tokens_per_s", "")])
    if fig is None:
        return reasons.logged("throughput.png", _count(records, Kind.TRAIN, "tokens_per_s"), "throughput figure")
    return fig


def step_time_figure(records: Records, reasons: Reasons) -> Drawn:
    """One bar of medians: a single timed step is something to show."""
    timings = records.of(Kind.TIMING)
    if not timings:
        return reasons.timed("step_time.png")
    fig, ax = _pyplot().subplots(figsize=(8, 2.6))
    left = 0.0
    for phase in PHASE_NAMES:
        value = statistics.median(number(t[f"{phase}_s"]) for t in timings) * 1000
        ax.barh([0], [value], left=left, label=f"{phase} {value:,.1f} ms")
        left += value
    ax.set_yticks([])
    ax.legend(ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    ax.set(xlabel="ms per step (median of the timed steps)", title="Time per step")
    return fig


def main_metrics(record: Record) -> list[str]:
    """What a task's panel plots: acc and acc_norm (multiple choice), bits per byte, else the loss
    (perplexity), else a harness task's first own metric."""
    if "acc" in record:
        return [key for key in ("acc", "acc_norm") if key in record]
    for key in ("bits_per_byte", "loss"):
        if key in record:
            return [key]
    skip = {"kind", "step", "task", "seconds", *TASK_COUNTS}
    other = next((k for k, v in record.items() if k not in skip and "stderr" not in k and is_number(v)), None)
    return [other] if other else []


def eval_tasks_figure(points: TaskPoints, reasons: Reasons) -> Drawn:
    """One panel per task, its main metrics against the step; left out when no task was evaluated
    often enough for a curve."""
    evaluations = max(len(records) for records in points.values())
    if not enough(evaluations):
        return reasons.evaluated("eval_tasks.png", evaluations)
    fig, axes = _pyplot().subplots(len(points), 1, figsize=(8, 2.6 * len(points)), squeeze=False)
    for ax, (task, records) in zip(axes[:, 0], points.items()):
        keys = main_metrics(records[-1])
        for key in keys:
            steps = [int(r["step"]) for r in records if key in r]
            ax.plot(steps, [number(r[key]) for r in records if key in r], "o-", ms=3, label=key.replace("_", " "))
        ax.set(xlabel="step", ylabel=" / ".join(k.replace("_", " ") for k in keys), title=task)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    return fig


# ---------------------------------------------------------------------------------------------
# drawing them
# ---------------------------------------------------------------------------------------------


def save_figures(figures: dict[str, Callable[[], Drawn]], folder: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """Draw each figure in order and save the ones with something to show as folder/NAME; the others
    are left out, each with its one-line reason, and a PNG of that name from an earlier report is
    removed (it would show the run as it was then). Returns (the PNGs written, by name; the reasons,
    by name)."""
    written: dict[str, Path] = {}
    left_out: dict[str, str] = {}
    folder.mkdir(parents=True, exist_ok=True)
    for name, draw in figures.items():
        drawn = draw()
        if isinstance(drawn, str):
            left_out[name] = drawn
            continue
        drawn.tight_layout()
        drawn.savefig(folder / name, dpi=90)
        _pyplot().close(drawn)
        written[name] = folder / name
    remove_stale(folder, left_out)
    return written, left_out


def draw_plots(records: Records, folder: Path, spikes: list[int], baseline: float | None,
               reasons: Reasons) -> tuple[dict[str, Path], dict[str, str]]:
    """The run's figures (not the evaluation tasks': `draw_eval_tasks`) into `folder`, as
    `save_figures` says."""
    figures: dict[str, Callable[[], Drawn]] = {
        "loss.png": lambda: loss_figure(records, reasons, spikes, baseline),
        "lr.png": lambda: lr_figure(records, reasons),
        "grad_norm.png": lambda: grad_norm_figure(records, reasons),
        "param_norm.png": lambda: param_norm_figure(records, reasons),
        "activations.png": lambda: activations_figure(records, reasons),
        "memory.png": lambda: memory_figure(records, reasons),
        "throughput.png": lambda: throughput_figure(records, reasons),
        "step_time.png": lambda: step_time_figure(records, reasons),
    }
    return save_figures(figures, folder)


def draw_eval_tasks(points: TaskPoints, folder: Path, reasons: Reasons) -> tuple[dict[str, Path], dict[str, str]]:
    """eval_tasks.png (`eval_tasks_figure`) into `folder`, as `save_figures` says."""
    return save_figures({"eval_tasks.png": lambda: eval_tasks_figure(points, reasons)}, folder)


def remove_stale(folder: Path, left_out: dict[str, str]) -> None:
    """An earlier report's PNG of a plot left out now (a report of the run while it was longer, or
    of a run dir reused): it would be read as this run's."""
    for name in left_out:
        (folder / name).unlink(missing_ok=True)
