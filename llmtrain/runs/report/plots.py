"""The report's figures: the loss with its baseline, spikes and alarm marks, and the health
quantities, one PNG each; a figure with too little to show is left out with the reason."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from llmtrain.core.files import (
    Kind,
)
from llmtrain.runs.leftout import Reasons, enough
from llmtrain.runs.records import Records, number
from llmtrain.runs.report.alarms import raised_alarms
from llmtrain.runs.report.learning import train_losses
from llmtrain.runs.report.resources import PHASE_NAMES
from llmtrain.runs.report.verdict import logged, steps_text

# ---------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------


def _plot_series(ax: Any, series: tuple[list[int], list[float]], label: str) -> bool:
    """Draw one (steps, values) curve; False when there is nothing to draw."""
    if not series[0]:
        return False
    ax.plot(*series, label=label or None)
    return True


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


def draw_plots(records: Records, folder: Path, spikes: list[int], baseline: float | None,
           reasons: Reasons) -> tuple[dict[str, Path], dict[str, str]]:
    """Draw the plots that have something to show (a curve of CURVE_MIN_POINTS points or more, a
    timed step); the others are left out, each with its one-line reason, and a PNG of that name
    from an earlier report is removed (it would show the run as it was then). Returns (the PNGs
    written, by name; the reasons, by name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    left_out: dict[str, str] = {}

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(folder / name, dpi=90)
        plt.close(fig)
        written[name] = folder / name

    def count(kind: str, key: str) -> int:
        return len(records.series(kind, key)[0])

    train_losses, val_losses = count(Kind.TRAIN, "loss"), count(Kind.EVAL, "val_loss")
    if enough(train_losses, val_losses):
        fig, ax = plt.subplots(figsize=(8, 4))
        draw_loss(ax, records, spikes, baseline, alarm_marks(records))
        save(fig, "loss.png")
    else:
        left_out["loss.png"] = reasons.logged("loss.png", train_losses, "train loss", "train losses")

    sched = records.series(Kind.HEALTH, "lr_schedule")
    if enough(count(Kind.TRAIN, "lr"), len(sched[0])):
        fig, ax = plt.subplots(figsize=(8, 3))
        ax.plot(*records.series(Kind.TRAIN, "lr"), label="applied")
        if sched[0]:
            ax.plot(*sched, "--", label="schedule (health checks)")
        ax.set(xlabel="step", ylabel="learning rate", title="Learning rate")
        ax.legend()
        save(fig, "lr.png")
    else:
        left_out["lr.png"] = reasons.logged("lr.png", count(Kind.TRAIN, "lr"), "learning rate")

    g_steps, g = records.series(Kind.TRAIN, "grad_norm")
    finite = [(s, v) for s, v in zip(g_steps, g) if math.isfinite(v) and v > 0]
    if enough(len(finite)):
        fig, ax = plt.subplots(figsize=(8, 3))
        ax.semilogy(*zip(*finite), lw=1)
        ax.axhspan(0.1, 10, color="green", alpha=0.08, label="healthy band (0.1-10)")
        ax.legend()
        ax.set(xlabel="step", ylabel="gradient norm (pre-clip)", title="Gradient norm")
        save(fig, "grad_norm.png")
    else:
        left_out["grad_norm.png"] = reasons.logged("grad_norm.png", len(finite), "finite gradient norm")

    def lines(name: str, title: str, ylabel: str, curves: list[tuple[str, str, str]]) -> bool:
        """One plot of record fields against the step: (kind, key, legend label) per curve; False
        (nothing drawn) when no curve has enough points."""
        if not enough(*(count(kind, key) for kind, key, _ in curves)):
            return False
        fig, ax = plt.subplots(figsize=(8, 3))
        drawn = [label for kind, key, label in curves if _plot_series(ax, records.series(kind, key), label)]
        if any(drawn):  # named curves (memory's) get a legend
            ax.legend()
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        save(fig, name)
        return True

    if not lines("param_norm.png", "Parameter norm", "parameter norm", [(Kind.HEALTH, "param_norm", "")]):
        left_out["param_norm.png"] = reasons.monitored("param_norm.png", count(Kind.HEALTH, "param_norm"),
                                                       "parameter norm")

    samples = [r for r in records.of(Kind.HEALTH) if r.get("activation_mean")]
    if enough(len(samples)):
        fig, (ax_mean, ax_var) = plt.subplots(1, 2, figsize=(10, 3.5))
        blocks = len(samples[0]["activation_mean"])
        for b in range(blocks):
            steps_b = [r["step"] for r in samples]
            ax_mean.plot(steps_b, [number(r["activation_mean"][b]) for r in samples], label=f"block {b}")
            ax_var.plot(steps_b, [number(r["activation_var"][b]) for r in samples], label=f"block {b}")
        if blocks <= 12:
            ax_var.legend(fontsize=7)
        ax_mean.set(xlabel="step", ylabel="mean", title="Block output mean")
        ax_var.set(xlabel="step", ylabel="variance", title="Block output variance")
        save(fig, "activations.png")
    else:
        left_out["activations.png"] = reasons.activations("activations.png", [int(r["step"]) for r in samples])

    memory_curves = [(Kind.HEALTH, "rss_mb", "process RSS"), (Kind.HEALTH, "cuda_allocated_mb", "GPU allocated"),
                     (Kind.HEALTH, "cuda_peak_mb", "GPU peak")]
    if not lines("memory.png", "Memory", "MB", memory_curves):
        left_out["memory.png"] = reasons.monitored(
            "memory.png", max(count(kind, key) for kind, key, _ in memory_curves), "memory")
    if not lines("throughput.png", "Throughput", "tokens/s", [(Kind.TRAIN, "tokens_per_s", "")]):
        left_out["throughput.png"] = reasons.logged("throughput.png", count(Kind.TRAIN, "tokens_per_s"),
                                                    "throughput figure")

    timings = records.of(Kind.TIMING)
    if timings:  # one bar of medians: a single timed step is something to show
        fig, ax = plt.subplots(figsize=(8, 2.6))
        left = 0.0
        for phase in PHASE_NAMES:
            value = statistics.median(number(t[f"{phase}_s"]) for t in timings) * 1000
            ax.barh([0], [value], left=left, label=f"{phase} {value:,.1f} ms")
            left += value
        ax.set_yticks([])
        ax.legend(ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35))
        ax.set(xlabel="ms per step (median of the timed steps)", title="Time per step")
        save(fig, "step_time.png")
    else:
        left_out["step_time.png"] = reasons.timed("step_time.png")
    remove_stale(folder, left_out)
    return written, left_out


def remove_stale(folder: Path, left_out: dict[str, str]) -> None:
    """An earlier report's PNG of a plot left out now (a report of the run while it was longer, or
    of a run dir reused): it would be read as this run's."""
    for name in left_out:
        (folder / name).unlink(missing_ok=True)
