"""SIGTERM and Ctrl-C at any time during `llmtrain train`.

- While setting up (composing the config, preparing data, building the model): the first SIGTERM
  stops at once with exit 75 (nothing to save yet; the same command starts the run), a Ctrl-C
  aborts with exit 130.
- In the train loop: the first signal lets the current optimizer step finish; the loop then saves
  a checkpoint and exits 75. After the loop (the final weights, the report) it lets the run end.
- A second signal, at any time, aborts within about a second: exit 130, nothing more saved.

Why a thread: Python runs a signal handler only between bytecodes of the main thread, so while the
main thread is inside `loss.backward()` or a long torch op, the handler waits for the whole call
(minutes for a slow step). The C-level handler still writes the signal number at once to the fd
given to `signal.set_wakeup_fd`; a daemon thread reading it prints the first signal's message at
once and, after a second signal, ends the process with `os._exit(130)` if the main thread has not
stopped on its own within ABORT_GRACE_S. Checkpoints and model.pt are written to a temporary name
and renamed, so an abort mid-save leaves the previous ones intact.
"""

from __future__ import annotations

import atexit
import enum
import os
import select
import signal
import statistics
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import NoReturn

from llmtrain.core import faults, rundir
from llmtrain.core.errors import EXIT_ABORTED, StoppedBeforeStart

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# After a second signal, the main thread gets this long to unwind by itself (the metrics' end
# record, closed sinks); then the watcher thread ends the process wherever the main thread is.
ABORT_GRACE_S = 1.0
# For a rank of a multi-process run, a signal within this long of the previous one is the same
# request: a scheduler signals every process of a job and the launcher (torchrun, parallel.nproc's
# parent) relays it too, so a rank gets one request twice within milliseconds; a person pressing
# Ctrl-C again takes longer. A single process gets each signal once: every one counts.
DUPLICATE_WINDOW_S = 1.0


class Phase(enum.Enum):
    SETUP = "setup"  # before the first step: a SIGTERM stops at once, there is nothing to save
    LOOP = "loop"  # the first signal finishes the current step, then the loop saves and stops
    FINISHING = "finishing"  # after the loop: the run ends by itself in a moment
    RELAY = "relay"  # a parent waiting for its ranks: signals are passed on to them


class AbortRequested(KeyboardInterrupt):
    """A second signal (or a Ctrl-C while setting up): stop at once, save nothing. A
    KeyboardInterrupt, so that no `except Exception` on the way swallows it; the CLI prints its
    message and exits 130."""


class _SetupStop(BaseException):
    """A SIGTERM while setting up, raised in the main thread wherever it is (a BaseException, for
    the same reason as KeyboardInterrupt); StopRequest's exit turns it into StoppedBeforeStart."""


_installed: StopRequest | None = None  # the instance whose handlers are in place
_announce_lock = threading.Lock()
_abort_announced = False


def announce_abort(message: str) -> None:
    """Print the abort's one line, once per process, whichever thread gets here first."""
    global _abort_announced
    with _announce_lock:
        if _abort_announced:
            return
        _abort_announced = True
    _say(f"\nllmtrain: aborted: {message}\n")


def _say(text: str) -> None:
    """Straight to fd 2, not through sys.stderr: from the watcher thread, sys.stderr's lock may be
    held by the main thread, which is exactly the thread that cannot move on (train.log's copy
    waits a moment at most). Rank 0 speaks for all ranks of a multi-process run."""
    if os.environ.get("RANK", "0") != "0":
        return
    try:
        os.write(2, text.encode())
    except OSError:
        pass
    rundir.log_console(text.strip("\n"))


def abort_message(err: KeyboardInterrupt) -> str:
    """The line for a KeyboardInterrupt that reached the CLI."""
    if isinstance(err, AbortRequested) and str(err):
        return str(err)
    return "interrupted (Ctrl-C): stopped at once, without saving; the checkpoints already written are intact"


def signal_text(name: str) -> str:
    """How a signal is named to the user: Ctrl-C is what they pressed."""
    return "Ctrl-C (SIGINT)" if name == "SIGINT" else name


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min"


class StopRequest:
    """SIGINT/SIGTERM handlers for the duration of a `with` block (main thread only; re-entrant:
    `StopRequest.shared()` is the one in place, so the CLI's and train()'s blocks share one).
    The train loop asks `requested(step)` after every optimizer step and reports each finished
    step with `step_finished()`, which gives the first signal's message the typical step time."""

    def __init__(self) -> None:
        self.signal_name: str | None = None  # the first signal: the loop stops after its step
        self.phase = Phase.LOOP
        self._depth = 0
        self._previous: dict[int, object] = {}
        self._previous_wakeup = -1
        self._read_fd = self._write_fd = -1
        self._watcher: threading.Thread | None = None
        # The count is kept by whichever thread reads the fd first. Re-entrant: the Python handler
        # can run in the main thread while that thread holds it.
        self._lock = threading.RLock()
        self._count = 0
        self._last_signal: float | None = None
        self._duplicate_window = DUPLICATE_WINDOW_S if int(os.environ.get("WORLD_SIZE") or 1) > 1 else 0.0
        self._setup_raised = False
        self._abort_timer: threading.Timer | None = None
        self._disarmed = False
        self._relay_to: list[int] = []
        self._step_started = time.monotonic()
        self._step_seconds: list[float] = []
        # Test-only: behave as if SIGTERM arrived after this step (faults.py).
        self._stop_at_step = faults.stop_at_step()

    @staticmethod
    def shared() -> StopRequest:
        """The StopRequest whose handlers are in place, or a new one."""
        return _installed or StopRequest()

    # ---- phases ------------------------------------------------------------------------------

    def setting_up(self) -> StopRequest:
        """From now on, a SIGTERM stops at once: nothing has been trained that a save would keep."""
        self.phase = Phase.SETUP
        self._setup_raised = False
        self._raise_pending_setup_stop()
        return self

    @contextmanager
    def looping(self) -> Iterator[StopRequest]:
        """The train loop: a first signal finishes the current step. Afterwards, the run ends by
        itself (final weights, report), so a first signal then only says so."""
        with self:
            if self.phase is Phase.SETUP:
                self._raise_pending_setup_stop(again=True)  # in case something on the way swallowed it
            self.phase = Phase.LOOP
            self._step_started = time.monotonic()
            try:
                yield self
            finally:
                self.phase = Phase.FINISHING

    @contextmanager
    def relaying(self, pids: Iterable[int]) -> Iterator[StopRequest]:
        """A parent waiting for its ranks: each signal is passed on to them, and the ranks decide
        (finish the step and save, or abort); this process waits for their exit codes."""
        with self:
            self.phase, self._relay_to = Phase.RELAY, list(pids)
            try:
                yield self
            finally:  # the ranks are done: what is left (the report) ends by itself
                self.phase, self._relay_to = Phase.FINISHING, []

    # ---- the loop's side ---------------------------------------------------------------------

    def step_finished(self) -> None:
        """One optimizer step is done: its duration is kept for the first signal's message."""
        now = time.monotonic()
        self._step_seconds = [*self._step_seconds[-19:], now - self._step_started]
        self._step_started = now

    def requested(self, step: int) -> bool:
        if self._stop_at_step is not None and step >= self._stop_at_step and self.signal_name is None:
            self.signal_name = "SIGTERM (test hook)"
        return self.signal_name is not None

    # ---- installing --------------------------------------------------------------------------

    def __enter__(self) -> StopRequest:
        global _installed
        self._depth += 1
        if self._depth == 1 and threading.current_thread() is threading.main_thread():  # signals reach it only
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            self._start_watcher()
            self._disarmed = False
            _installed = self
        return self

    def __exit__(self, kind: type | None, value: BaseException | None, tb: TracebackType | None) -> None:
        global _installed
        self._depth -= 1
        if self._depth == 0 and self._previous:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()
            self._stop_watcher()
            if not isinstance(value, KeyboardInterrupt):  # no abort under way: no deadline either
                with self._lock:
                    self._disarmed = True
                    if self._abort_timer is not None:
                        self._abort_timer.cancel()
            if _installed is self:
                _installed = None
        if isinstance(value, _SetupStop):
            raise StoppedBeforeStart(  # after the CLI's `llmtrain: stopped:`
                f"{value.args[0]} while setting up, before the first step: nothing to save yet (any checkpoints "
                "already written are intact); the same command starts the run again"
            ) from None

    def _start_watcher(self) -> None:
        try:
            self._read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._write_fd, False)  # set_wakeup_fd requires it: a signal must never block
            os.set_blocking(self._read_fd, False)  # both threads read it; neither may hang on an empty pipe
            self._previous_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        except (OSError, ValueError):  # no pipe: the Python handler alone (an abort then waits for the main thread)
            self._close_fds()
            return
        self._watcher = threading.Thread(target=self._watch, args=(self._read_fd,), name="llmtrain-signals",
                                         daemon=True)
        self._watcher.start()

    def _stop_watcher(self) -> None:
        if self._watcher is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup)
        os.close(self._write_fd)  # the watcher sees the end of the pipe and returns
        self._write_fd = -1
        self._watcher.join(timeout=2)
        self._watcher = None
        self._close_fds()

    def _close_fds(self) -> None:
        with self._lock:
            for fd in (self._read_fd, self._write_fd):
                if fd >= 0:
                    os.close(fd)
            self._read_fd = self._write_fd = -1

    def _watch(self, fd: int) -> None:
        while True:
            try:
                select.select([fd], [], [])
            except (OSError, ValueError):
                return
            if not self._drain():
                return

    def _drain(self) -> bool:
        """Take the signal numbers waiting in the pipe; False at its end (closed)."""
        with self._lock:
            if self._read_fd < 0:
                return False
            try:
                data = os.read(self._read_fd, 64)
            except BlockingIOError:  # the other thread took them
                return True
            except OSError:  # closed under us (the block is ending): nothing more to read
                return False
            if not data:
                return False
            messages = [self._count_signal(signal.Signals(n).name) for n in data if n in SIGNALS]
        for message in messages:
            if message:
                _say(message)
        return True

    # ---- what a signal does ------------------------------------------------------------------

    def _count_signal(self, name: str) -> str | None:
        """One signal, as it arrives (with the lock held, from either thread); returns the message
        to print (printed by the caller, once the lock is released)."""
        if self.phase is Phase.RELAY:
            return None  # the main thread passes it on; the ranks count
        now = time.monotonic()
        if self._last_signal is not None and now - self._last_signal < self._duplicate_window:
            return None
        self._last_signal = now
        self._count += 1
        if self._count == 1:
            self.signal_name = name
            # Set-up stops at once and the CLI says so; the loop takes a while: say how long.
            return None if self.phase is Phase.SETUP else self._first_message(name)
        if self._count == 2 and not self._disarmed:
            self._abort_timer = threading.Timer(ABORT_GRACE_S, self._abort_now, args=(self._abort_text(name),))
            self._abort_timer.daemon = True
            self._abort_timer.start()
        return None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler, in the main thread, once it runs bytecode again."""
        if self.phase is Phase.RELAY:
            for pid in self._relay_to:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
            return
        if self._watcher is None or not self._drain():  # no watcher: count here
            with self._lock:
                message = self._count_signal(signal.Signals(signum).name)
            if message:
                _say(message)
        if self._count >= 2:
            raise AbortRequested(self._abort_text(signal.Signals(signum).name))
        self._raise_pending_setup_stop()

    def _raise_pending_setup_stop(self, again: bool = False) -> None:
        if self.phase is not Phase.SETUP or self.signal_name is None or (self._setup_raised and not again):
            return
        self._setup_raised = True
        if self.signal_name == "SIGINT":
            raise AbortRequested("interrupted (Ctrl-C) while setting up, before the first step: nothing to save yet "
                                 "(any checkpoints already written are intact); the same command starts the run again")
        raise _SetupStop(self.signal_name)

    def _abort_now(self, message: str) -> None:
        """The deadline after a second signal (a timer thread): the main thread did not get out in
        time, so the process ends here, wherever the main thread is."""
        with self._lock:
            if self._disarmed:
                return
        abort_at_once(message)

    def _abort_text(self, name: str) -> str:
        where = ("mid-step" if self.phase is Phase.LOOP else "while setting up" if self.phase is Phase.SETUP
                 else "at the end")
        return (f"a second signal ({'Ctrl-C' if name == 'SIGINT' else name}): stopped at once, {where}, without "
                "saving; the checkpoints already written are intact")

    def _first_message(self, name: str) -> str:
        again = "a second SIGTERM or Ctrl-C aborts at once, without saving"
        if self.phase is Phase.FINISHING:
            return f"\nllmtrain: {signal_text(name)} received: training is done and the run is finishing; {again}\n"
        running = time.monotonic() - self._step_started
        if self._step_seconds:
            typical = statistics.median(self._step_seconds)
            timing = f"a step takes about {_duration(typical)} and this one started {_duration(running)} ago"
        else:
            timing = f"the first step started {_duration(running)} ago, its duration is not known yet"
        return (f"\nllmtrain: {signal_text(name)} received: finishing the current step ({timing}), then saving a "
                f"checkpoint; {again}\n")


def abort_at_once(message: str) -> NoReturn:
    """Say so in one line, then end the process with 130, skipping the interpreter's teardown
    (which can take seconds: an abort is asked for because the run must end now)."""
    announce_abort(message)
    _flush_briefly()
    os._exit(EXIT_ABORTED)


def exit_promptly(code: int) -> NoReturn:
    """End a run that stopped on request, now that it has said everything: the atexit handlers run
    (train.log, W&B) and the streams are flushed, but not the interpreter's teardown, whose garbage
    collections walk the ~300,000 objects torch and Hydra leave behind: 0.4-1.2 s on a quiet 2-core
    machine and 4-5 s on a busy one, the longest wait of a Ctrl-C, for a process that is ending.
    Only for a process of its own (the CLI's entry point), never for a caller's."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _flush_briefly() -> None:
    """Flush stdout and stderr, but never wait long: the main thread may hold their locks."""
    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass

    helper = threading.Thread(target=flush, daemon=True)
    helper.start()
    helper.join(timeout=0.5)

