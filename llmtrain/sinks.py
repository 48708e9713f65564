"""Where a run's progress goes: the terminal (rich) and metrics.jsonl in the run dir."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


class JsonlSink:
    """One JSON object per line, flushed at once, so a crashed run keeps what it logged."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        # Strict JSON has no NaN/Infinity: write them as the strings "nan", "inf", "-inf".
        clean = {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self.file.write(json.dumps(clean, allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _default_console() -> Console:
    """Rich wraps at 80 columns when not on a terminal (CI, `| tee`); logs read better wider."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=120)
    return console


class ConsoleSink:
    """Banner, a live progress bar on a terminal (plain log lines elsewhere), and a summary."""

    def __init__(self, total_steps: int, console: Console | None = None) -> None:
        self.console = console or _default_console()
        self.total_steps = total_steps
        self.progress: Progress | None = None
        self.task = None
        self.last_line = time.monotonic()

    def banner(self, title: str, rows: list[tuple[str, str]]) -> None:
        table = Table(title=title, show_header=False, title_justify="left", box=None, padding=(0, 2))
        table.add_column(style="bold cyan")
        table.add_column()
        for key, value in rows:
            table.add_row(key, value)
        self.console.print(table)

    def start(self) -> None:
        if not self.console.is_terminal:
            return
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task("train", total=self.total_steps, status="")
        self.progress.start()

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def log_train(self, record: dict[str, Any]) -> None:
        status = (
            f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  gnorm {record['grad_norm']:.2f}  "
            f"{record['tokens_per_s']:,.0f} tok/s"
        )
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"], status=status)
        else:
            self.console.print(f"step {record['step']:>6}/{self.total_steps}  {status}", highlight=False)

    def log_eval(self, record: dict[str, Any]) -> None:
        self.print(
            f"[bold green]eval[/] step {record['step']}: val loss {record['val_loss']:.4f}  "
            f"val ppl {record['val_ppl']:.2f}"
        )

    def print(self, *args: Any, **kwargs: Any) -> None:
        target = self.progress.console if self.progress is not None else self.console
        target.print(*args, **kwargs)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
