"""The training console: the banner, a live progress bar with the health bands on a terminal (plain
log lines elsewhere), alarms and evaluations as they happen."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from llmtrain.core import rundir
from llmtrain.core.console import ShownAs, default_console, is_plain
from llmtrain.metrics.text import task_metrics_text


class Dashboard:
    """Banner, a live progress bar on a terminal (plain log lines elsewhere), and a summary."""

    def __init__(self, total_steps: int, console: Console | None = None) -> None:
        self.console = console or default_console()
        self.total_steps = total_steps
        self.progress: Progress | None = None
        self.task = None
        self.live: Live | None = None
        self.health_rows: list[tuple[str, str, str]] = []

    def banner(self, title: str, rows: list[tuple[str, str]]) -> None:
        width = max((len(key) for key, _ in rows), default=0)
        lines = [title, *(f"  {key:<{width}}    {value}" for key, value in rows)]
        if is_plain(self.console):  # one line per row, however long: the table would wrap its values
            for line in lines:
                self.console.print(line, markup=False, highlight=False)
            return
        table = Table(title=title, show_header=False, title_justify="left", box=None, padding=(0, 2))
        table.add_column(style="bold cyan")
        table.add_column()
        for key, value in rows:
            table.add_row(key, value)
        self.console.print(ShownAs(table, "\n".join(lines)))  # train.log: the lines a pipe shows

    def start(self) -> None:
        if not self.console.is_terminal:
            return
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            # Our own ETA (training/eta.py): from the start-up estimate before the first step ends,
            # then from the steps' durations, evaluations and saves kept out (rich's needs two samples).
            TextColumn("{task.fields[eta]}"),
            console=self.console,
        )
        self.task = self.progress.add_task("train", total=self.total_steps, status="", eta="ETA -:--")
        self.live = Live(self._dashboard(), console=self.console, refresh_per_second=4)
        self.live.start()

    def _dashboard(self) -> Group:
        assert self.progress is not None
        if not self.health_rows:
            return Group(self.progress)
        table = Table(title="health bands", title_justify="left", box=None, padding=(0, 2))
        for col in ("metric", "value", "state"):
            table.add_column(col)
        for metric, value, state in self.health_rows:
            color = {"ok": "green", "watch": "yellow", "alarm": "red"}[state]
            table.add_row(metric, value, f"[{color}]{state}[/]")
        return Group(self.progress, table)

    def advance(self, step: int, eta: str | None = None) -> None:
        """The bar at `step`; `eta` its ETA text ("ETA 2:31", "ETA ~6:48")."""
        if self.progress is not None:
            if eta is None:
                self.progress.update(self.task, completed=step)
            else:
                self.progress.update(self.task, completed=step, eta=eta)

    def log_train(self, record: dict[str, Any], timing: str = "", above_bar: bool = False) -> None:
        """A log line: loss, lr, grad norm, tokens/s, then `timing` ("12.3 s/step  1:02 elapsed,
        ETA 2:31"). On a terminal the bar's status shows it (the bar has its own clock), and
        `above_bar` prints the whole line above the bar too (slow steps: every step's time stays)."""
        status = (
            f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  gnorm {record['grad_norm']:.2f}  "
            f"{record['tokens_per_s']:,.0f} tok/s"
        )
        line = f"step {record['step']:>6}/{self.total_steps}  {status}" + (f"  {timing}" if timing else "")
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"], status=status)
            if not above_bar:  # shown in the bar alone: train.log still gets the line
                rundir.log_console(line)
                return
        self.console.print(line, highlight=False)

    def alarm(self, alarm: Any) -> None:
        """An alarm, printed once with its explanation (the monitor re-raises only after it cleared)."""
        color = "red" if alarm.severity == "critical" else "yellow"
        self.print(f"[bold {color}]alarm[/] {escape(alarm.explain())}", markup=True, highlight=False)

    def health(self, record: dict[str, Any], active: list[str]) -> None:
        """The latest health check: the dashboard's panel on a terminal; nothing extra elsewhere
        (the alarms themselves are printed once, and every value is in metrics.jsonl)."""
        self.health_rows = health_rows(record, active)
        if self.live is not None:
            self.live.update(self._dashboard())

    def log_eval(self, record: dict[str, Any]) -> None:
        self.print(
            f"[bold green]eval[/] step {record['step']}: val loss {record['val_loss']:.4f}  "
            f"val ppl {record['val_ppl']:.2f}"
        )

    def log_eval_task(self, record: dict[str, Any]) -> None:
        """One evaluation task's result, after the val loss: "perplexity:held.txt  loss 1.2340  ppl 3.43
        bits/byte 1.7800"."""
        self.print(f"[bold green]eval[/] step {record['step']}: {escape(str(record['task']))}  "
                   f"{escape(task_metrics_text(record))}", highlight=False)

    def print(self, *args: Any, **kwargs: Any) -> None:
        self.console.print(*args, **kwargs)  # above the live display when there is one

    def stop(self) -> None:
        if self.live is not None:
            self.live.update(self._dashboard())
            self.live.stop()
            self.live = None
        self.progress = None


ALARMS_BY_METRIC = {
    "gradient norm": ("grad_norm_high", "grad_norm_surge", "grad_norm_low", "grad_norm_low_early_layers"),
    "parameter norm": ("param_norm_jump", "param_norm_decrease", "update_ratio_high", "update_ratio_low",
                       "weight_decay_dominant", "steps_too_small"),
    "learning rate": ("lr_zero", "lr_exploding", "schedule_ended"),
    "activation mean": ("activation_mean_drift",),
    "activation variance": ("activation_variance_high", "activation_variance_growing", "activation_variance_shrinking"),
    "memory": ("memory_leak",),
    "loss": ("loss_spike", "loss_above_chance", "loss_rising", "loss_not_decreasing", "loss_oscillating",
             "loss_autocorrelated", "overfitting"),
}


def health_rows(record: dict[str, Any], active: list[str]) -> list[tuple[str, str, str]]:
    """(metric, value, ok|watch|alarm) per row of the health table, at the latest check."""
    grad = record["grad_norm"]
    values = {
        "gradient norm": f"{grad:.3g}",
        "parameter norm": f"{record['param_norm']:.4g}",
        "learning rate": f"{record['lr_applied']:.3g} (schedule {record['lr_schedule']:.3g})",
        "activation mean": _spread(record.get("activation_mean")),
        "activation variance": _spread(record.get("activation_var")),
        "memory": f"{record['rss_mb']:,.0f} MB RSS",
        "loss": f"{record['loss']:.4f}",
    }
    rows = []
    for metric, alarms in ALARMS_BY_METRIC.items():
        state = "alarm" if any(a in active for a in alarms) else "ok"
        if state == "ok" and metric == "gradient norm" and not 0.1 <= grad <= 10:
            state = "watch"  # outside the healthy 0.1-10 band, not (yet) persistently
        rows.append((metric, values[metric], state))
    return rows


def _spread(values: list[float] | None) -> str:
    if not values:
        return "-"
    return f"{min(values):.3g} .. {max(values):.3g} over {len(values)} blocks"
