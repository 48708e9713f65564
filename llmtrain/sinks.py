"""Where a run's progress goes: the terminal (rich), its plain copy in the run's train.log, and
metrics.jsonl in the run dir."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from rich.console import Console, Group, NewLine
from rich.control import Control
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from llmtrain.errors import UserError
from llmtrain.runs import rundir
from llmtrain.runs.files import METRICS, Kind


def _finite_or_string(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite_or_string(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_string(v) for v in value]
    return value


def _warn_on_stderr(message: str) -> None:
    print(f"llmtrain: warning: {message}", file=sys.stderr)
    rundir.log_console(f"llmtrain: warning: {message}")


class JsonlSink:
    """One JSON object per line, each appended whole and unbuffered, so a crashed run keeps what
    it logged and a full disk never leaves half a line (nor stops the run: see `_append`)."""

    def __init__(self, path: Path, warn: Callable[[str], None] | None = None) -> None:
        self.path = Path(path)
        self.file = open(self.path, "ab", buffering=0)
        self.warn = warn or _warn_on_stderr
        self.dropped = 0

    def write(self, record: dict[str, Any]) -> None:
        # Strict JSON has no NaN/Infinity: write them as the strings "nan", "inf", "-inf".
        line = (json.dumps(_finite_or_string(record), allow_nan=False) + "\n").encode()
        if not self.file.closed:
            self._append(self.file, line)
            return
        # A record after close (the end of a run writes its last peaks once the weights are out)
        # is appended through a handle of its own, rather than raising or being lost.
        try:
            with open(self.path, "ab", buffering=0) as fh:
                self._append(fh, line)
        except OSError as err:
            self._dropped(err)

    def _append(self, fh: BinaryIO, line: bytes) -> None:
        """Write `line` whole, or drop it: a failed write (disk full) is cut off again, so the
        file stays whole lines and the earlier records intact; training goes on, warned once."""
        start = fh.seek(0, os.SEEK_END)
        try:
            view = memoryview(line)
            while view:
                view = view[fh.write(view):]  # a raw write may be short on a nearly full disk
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(fh.fileno(), start)
            self._dropped(err)

    def _dropped(self, err: OSError) -> None:
        self.dropped += 1
        if self.dropped == 1:
            self.warn(f"could not append to {self.path} ({err}); its records are dropped while that lasts "
                      "(the ones before are intact)")

    def close(self) -> None:
        self.file.close()
        if self.dropped:
            self.warn(f"{self.dropped} record(s) could not be written to {self.path} (see above)")


# Piped output (a file, `| tee`, CI) draws tables this wide: five columns of the check table stay
# readable, and it is the width the test helpers set through COLUMNS.
PIPED_TABLE_WIDTH = 160


class _TrimmedLines:
    """A text stream that drops the spaces rich pads lines with before each line break (table cells,
    justified text), so piped output has no trailing whitespace. The target stream is looked up at
    each write: sys.stdout may be replaced after the console is made (pytest's capture)."""

    def __init__(self, stream: Callable[[], TextIO]) -> None:
        self._stream = stream
        self._spaces = ""  # trailing spaces of the last write: dropped if a line break follows

    def write(self, text: str) -> int:
        *lines, last = (self._spaces + text).split("\n")
        kept = last.rstrip(" ")
        self._spaces = last[len(kept):]
        self._stream().write("\n".join([line.rstrip(" ") for line in lines] + [kept]))
        return len(text)

    def flush(self) -> None:
        self._stream().flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._stream().fileno()

    @property
    def encoding(self) -> str:
        return getattr(self._stream(), "encoding", None) or "utf-8"


@dataclass
class ShownAs:
    """A renderable that train.log keeps as `text` (the banner's table: as the lines a pipe shows)."""

    renderable: Any
    text: str

    def __rich__(self) -> Any:
        return self.renderable


def plain_text(*objects: Any, **kwargs: Any) -> str:
    """What `console.print(*objects, **kwargs)` shows piped (COLUMNS unset): no colour or control
    codes, text unwrapped, tables PIPED_TABLE_WIDTH wide, no trailing spaces."""
    out = io.StringIO()
    Console(file=out, width=PIPED_TABLE_WIDTH, soft_wrap=True, color_system=None, force_terminal=False,
            force_jupyter=False, force_interactive=False).print(
        *(o.text if isinstance(o, ShownAs) else o for o in objects), **kwargs)
    return "\n".join(line.rstrip(" ") for line in out.getvalue().splitlines())


class LoggedConsole(Console):
    """A console whose prints are also copied, as plain text, into the run's train.log while
    `llmtrain train` keeps one (rundir.log_console). A live display's redraws (control codes, and
    the line break that ends it) are not copied; the step lines a progress bar stands for are
    (ConsoleSink.log_train)."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        super().print(*objects, **kwargs)
        if rundir.job_log_kept() and not (objects and all(isinstance(o, Control | NewLine) for o in objects)):
            rundir.log_console(plain_text(*objects, **kwargs))


def default_console(stderr: bool = False) -> Console:
    """A rich console for stdout (or stderr), whose prints a run's train.log keeps too (LoggedConsole).
    On a terminal: rich's own. Elsewhere (a file, a pipe, CI) plain lines: no colour codes, no
    trailing padding, and, unless COLUMNS is set (then it is the width, as on a terminal that wide),
    text that is never hard-wrapped: a message stays one line, whole for grep. Tables are then drawn
    PIPED_TABLE_WIDTH wide, their cells wrapping inside their column (see `is_plain`)."""
    console = LoggedConsole(stderr=stderr)
    if console.is_terminal:
        return console
    explicit_width = "COLUMNS" in os.environ
    return LoggedConsole(
        file=_TrimmedLines((lambda: sys.stderr) if stderr else (lambda: sys.stdout)),
        width=None if explicit_width else PIPED_TABLE_WIDTH,
        soft_wrap=not explicit_width,
    )


def is_plain(console: Console) -> bool:
    """Whether `console` writes unwrapped plain lines (piped, COLUMNS unset): key/value output is then
    printed as lines rather than as a table that would wrap long values."""
    return console.soft_wrap and not console.is_terminal


SKIP_KEYS = {"kind", "step", "time", "alarm", "action", "path", "removed", "error", "band", "severity", "metric", "detail",
             "resumed_from"}


# Record kinds the dashboards skip (no curve to draw) and the ones they show as text.
NOT_PLOTTED = (Kind.START, Kind.CHECKPOINT, Kind.CHECKPOINT_ERROR)
EVENT_KINDS = (Kind.ALARM, Kind.ACTION)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record as flat `kind/key[/index]` scalars (NaN kept: a dashboard shows where it happened);
    an evaluation task's as `eval_task/<task entry>/<metric>`, one curve per task and metric."""
    kind, out = record.get("kind", ""), {}
    prefix = f"{kind}/{record.get('task')}" if kind == Kind.EVAL_TASK else kind
    for key, value in record.items():
        if key in SKIP_KEYS or (kind == Kind.EVAL_TASK and key == "task"):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}/{key}"] = float(value)
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            out.update({f"{prefix}/{key}/{i}": float(v) for i, v in enumerate(value)})
    return out


def event_text(record: dict[str, Any]) -> str:
    return f"step {record.get('step')}: {record.get('alarm', '')} -> {record.get('action')} {record.get('detail', '')}"


class TensorBoardSink:
    """Scalars of every metrics record for TensorBoard (`pip install 'llmtrain[tensorboard]'`)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step, kind = record.get("step"), record.get("kind", "")
        if step is None or kind in NOT_PLOTTED:
            return
        if kind in EVENT_KINDS:  # events are text, not scalars
            self.writer.add_text(f"events/{kind}", event_text(record), step)
            return
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Weights & Biases (`pip install 'llmtrain[wandb]'`); `offline` writes RUN_DIR/wandb/ with no network,
    to upload later with `wandb sync`."""

    def __init__(self, run_dir: Path, mode: str, project: str, config: dict) -> None:
        import wandb  # an optional extra: imported only when asked for

        try:
            self.run = wandb.init(mode=mode, dir=str(run_dir), project=project, config=config, name=Path(run_dir).name)
        except Exception as err:  # no network, no API key, ...: the user's setting, said in one paragraph
            raise UserError(
                f"W&B could not start (wandb={mode}): {' '.join(str(err).split())[:300].rstrip('.')}. Use wandb=offline (no network; "
                "upload later with `wandb sync`), log in with `wandb login`, or set wandb=off."
            ) from None

    def write(self, record: dict[str, Any]) -> None:
        step, kind = record.get("step"), record.get("kind", "")
        if step is None or kind in NOT_PLOTTED:
            return
        values: dict[str, Any] = scalars(record) if kind not in EVENT_KINDS else {f"events/{kind}": event_text(record)}
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class NullSink:
    """Where a rank other than 0 writes its records: nowhere (rank 0 writes the run's files)."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class MetricsSink:
    """metrics.jsonl, plus TensorBoard and W&B when asked for: one `write` feeds them all."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, wandb: str = "off", wandb_project: str = "llmtrain",
                 config: dict | None = None, warn: Callable[[str], None] | None = None) -> None:
        self.jsonl = JsonlSink(run_dir / METRICS, warn)
        self.sinks: list[Any] = [self.jsonl]
        if tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        if wandb != "off":
            self.sinks.append(WandbSink(run_dir, wandb, wandb_project, config or {}))
        self.closed = False

    def write(self, record: dict[str, Any]) -> None:
        # After close, metrics.jsonl (the run's record, which report and compare read) still gets
        # the record; TensorBoard and W&B are finished and cannot take more.
        for sink in [self.jsonl] if self.closed else self.sinks:
            sink.write(record)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sink in self.sinks:
            sink.close()


class ConsoleSink:
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


# An evaluation task's headline metrics, in this order, as (key, label, format): the rest (counts,
# standard errors) are in metrics.jsonl. A harness task's own metrics are shown when none of these is there.
TASK_HEADLINE = (("loss", "loss", "{:.4f}"), ("perplexity", "ppl", "{:.2f}"), ("bits_per_byte", "bits/byte", "{:.4f}"),
                 ("acc", "acc", "{:.4f}"), ("acc_norm", "acc_norm", "{:.4f}"))
TASK_COUNTS = ("tokens", "bytes", "documents", "examples")
TASK_OTHER_SHOWN = 4  # a harness task's metrics on one line, at most


def task_metrics_text(metrics: dict[str, Any], sep: str = "  ") -> str:
    """A task's headline metrics on one line: "loss 1.2340  ppl 3.43  bits/byte 1.7800", "acc 0.4000
    acc_norm 0.4500", or (a harness task) its own numeric metrics, standard errors and counts left out."""
    shown = [(label, fmt, metrics[key]) for key, label, fmt in TASK_HEADLINE if is_number(metrics.get(key))]
    if not shown:
        skip = {"kind", "step", "task", "seconds", *TASK_COUNTS}
        shown = [(key, "{:.4g}", value) for key, value in metrics.items()
                 if key not in skip and "stderr" not in key and is_number(value)][:TASK_OTHER_SHOWN]
    return sep.join(f"{label} {fmt.format(value) if math.isfinite(value) else value}" for label, fmt, value in shown)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scored_text(metrics: dict[str, Any], keys: tuple[str, ...] = TASK_COUNTS, at_most: int | None = None) -> str:
    """How much a task scored, from its counts: '1,500 tokens, 1,500 bytes, 1 document'."""
    counts = [f"{metrics[key]:,} {key if metrics[key] != 1 else key.removesuffix('s')}"
              for key in keys if is_number(metrics.get(key)) and isinstance(metrics[key], int)]
    return ", ".join(counts[:at_most])


ALARMS_BY_METRIC = {
    "gradient norm": ("grad_norm_high", "grad_norm_surge", "grad_norm_low", "grad_norm_low_early_layers"),
    "parameter norm": ("param_norm_jump", "param_norm_decrease", "update_ratio_high", "update_ratio_low",
                       "weight_decay_dominant"),
    "learning rate": ("lr_zero", "lr_exploding", "schedule_ended"),
    "activation mean": ("activation_mean_drift",),
    "activation variance": ("activation_variance_high", "activation_variance_growing", "activation_variance_shrinking"),
    "memory": ("memory_leak",),
    "loss": ("loss_spike", "loss_above_chance", "loss_rising", "loss_not_decreasing", "loss_oscillating"),
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
