"""Every test-only fault injection, in one place: the environment variables the tests set, read
here and nowhere else. Production modules ask this module what to inject; with none of the
variables set, every hook does nothing.

    LLMTRAIN_TEST_NAN_AT_STEPS=3,6        the loss and grad norm of those steps become NaN (each
                                          listed occurrence once: "6,6" poisons step 6 twice)
    LLMTRAIN_TEST_CRASH_RANK_AT=RANK:STEP that rank fails at that step (a crashed DDP worker)
    LLMTRAIN_TEST_SLOW_BACKWARD=STEP:S    from that step on, every backward is held in C++ for S s
    LLMTRAIN_TEST_STOP_AT_STEP=N          the run behaves as if SIGTERM arrived after step N
    LLMTRAIN_TEST_LEAK_MB_PER_STEP=MB     the monitor keeps MB alive per step (a leak)

Steps are 1-based numbers of the step being taken, as everywhere in the loop's records.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: interrupts.py asks this module before any torch
    import torch


def stop_at_step() -> int | None:
    """LLMTRAIN_TEST_STOP_AT_STEP: the step after which the run acts as if SIGTERM arrived."""
    return int(os.environ.get("LLMTRAIN_TEST_STOP_AT_STEP", "0")) or None


def leak_mb_per_step() -> float:
    """LLMTRAIN_TEST_LEAK_MB_PER_STEP: MB the monitor keeps alive per step (0: none)."""
    return float(os.environ.get("LLMTRAIN_TEST_LEAK_MB_PER_STEP", "0"))


@dataclass
class Faults:
    """The train loop's injections, read from the environment once per run."""

    nan_at_steps: list[int] = field(default_factory=list)
    crash_rank: int | None = None
    crash_step: int | None = None
    slow_from_step: int | None = None
    slow_seconds: float = 0.0

    @classmethod
    def from_env(cls) -> Faults:
        crash_rank, _, crash_step = os.environ.get("LLMTRAIN_TEST_CRASH_RANK_AT", "").partition(":")
        slow_from, _, slow_seconds = os.environ.get("LLMTRAIN_TEST_SLOW_BACKWARD", "").partition(":")
        return cls(
            nan_at_steps=[int(s) for s in os.environ.get("LLMTRAIN_TEST_NAN_AT_STEPS", "").split(",") if s],
            crash_rank=int(crash_rank) if crash_rank else None,
            crash_step=int(crash_step) if crash_rank else None,
            slow_from_step=int(slow_from) if slow_from else None,
            slow_seconds=float(slow_seconds) if slow_from else 0.0,
        )

    def maybe_crash(self, rank: int, step: int) -> None:
        """Fail this rank at `step` if asked to."""
        if self.crash_rank is not None and self.crash_rank == rank and step == self.crash_step:
            raise RuntimeError(f"test crash of rank {rank} at step {step}")

    def poison(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss and grad norm, made NaN at a listed step (that occurrence is used up)."""
        if step not in self.nan_at_steps:
            return loss, grad_norm
        self.nan_at_steps.remove(step)
        return loss * math.nan, grad_norm * math.nan

    def slow_backward(self, model: torch.nn.Module, current_step: Callable[[], int]) -> None:
        """From the configured step on, hold every backward pass in C++ (a slow step: the main
        thread runs no bytecode meanwhile, so Python signal handlers wait)."""
        if self.slow_from_step is not None:
            slow_from, seconds = self.slow_from_step, self.slow_seconds
            next(model.parameters()).register_hook(
                lambda grad: hold_in_cpp(seconds) if current_step() + 1 >= slow_from else None)


def hold_in_cpp(seconds: float) -> None:
    """Keep the calling thread inside one C++ call of torch for `seconds`, with the GIL released,
    as a long backward pass does: no bytecode of this thread runs meanwhile, so its Python signal
    handlers wait, while other threads run."""
    if os.environ.get("RANK", "0") == "0":  # straight to fd 2, as interrupts.py speaks; rank 0 for all
        try:
            os.write(2, f"llmtrain: test hook: holding the main thread in C++ for {seconds:g} s\n".encode())
        except OSError:
            pass
    import torch

    done: torch.futures.Future = torch.futures.Future()
    timer = threading.Timer(seconds, done.set_result, args=(None,))
    timer.daemon = True
    timer.start()
    done.wait()
