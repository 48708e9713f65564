"""The live bar a data preparation shows on a terminal: bytes, documents, tokens/s and the time left."""

from __future__ import annotations

import time
from collections.abc import Callable


class ProgressBar:
    """A rich progress bar on stderr (bytes, MB/s, documents, tokens/s, ETA) while data is prepared;
    does nothing when disabled or when stderr is not a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.progress = None
        self.task = None
        self.documents = self.tokens = 0
        self.started = 0.0
        if enabled:
            from rich.console import Console

            console = Console(stderr=True)
            if console.is_terminal:
                from rich.progress import (
                    BarColumn,
                    DownloadColumn,
                    Progress,
                    TextColumn,
                    TimeRemainingColumn,
                    TransferSpeedColumn,
                )

                self.progress = Progress(
                    TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TextColumn("{task.fields[documents]:,} docs, {task.fields[rate]}"), TimeRemainingColumn(),
                    console=console, transient=True,
                )

    def routed(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """`log`, or, while the bar is live, a print above the bar (not into its line)."""
        if self.progress is None:
            return log
        from rich.text import Text

        return lambda message: self.progress.console.print(Text(message, style="dim"))

    def __enter__(self) -> ProgressBar:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def start(self, description: str, total_bytes: int) -> None:
        self.documents = self.tokens = 0
        self.started = time.perf_counter()
        if self.progress is not None:
            if self.task is not None:
                self.progress.remove_task(self.task)
            self.task = self.progress.add_task(description, total=total_bytes, documents=0, rate="")

    def advance(self, nbytes: int, documents: int = 0, tokens: int = 0) -> None:
        if self.progress is None:
            return
        self.documents += documents
        self.tokens += tokens
        rate = f"{self.tokens / max(time.perf_counter() - self.started, 1e-9):,.0f} tokens/s" if self.tokens else ""
        self.progress.update(self.task, advance=nbytes, documents=self.documents, rate=rate)
