"""SIGTERM and Ctrl-C: finish the current optimizer step, save, exit; a second Ctrl-C aborts."""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType


class StopRequest:
    """Installed around the train loop; the loop asks `requested` after every optimizer step."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        # Test-only: behave as if SIGTERM arrived after this step (LLMTRAIN_TEST_STOP_AT_STEP=N).
        self._stop_at_step = int(os.environ.get("LLMTRAIN_TEST_STOP_AT_STEP", "0")) or None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind: type | None, value: BaseException | None, tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: abort now, save nothing
        self.signal_name = signal.Signals(signum).name
        sys.stderr.write(
            f"\nllmtrain: {self.signal_name} received: finishing the current step, then saving a checkpoint "
            "(Ctrl-C again aborts at once, without saving)\n"
        )

    def requested(self, step: int) -> bool:
        if self._stop_at_step is not None and step >= self._stop_at_step and self.signal_name is None:
            self.signal_name = "SIGTERM (test hook)"
        return self.signal_name is not None
