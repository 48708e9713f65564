"""The health monitor's cost: llmtrain's step time with the monitor on (default interval) and off.

    python benchmarks/bench_monitor.py [--steps 60] [--warmup 10] [--reps 3]

Both configurations run the real `train()` on the default model and data, alternating in one
process; each timing covers the steps after `--warmup`. Reported: median ms/step of each and the
overhead of the monitor (target <= 3%). On a machine whose speed drifts between repetitions that
difference is noisy, so one more run with the monitor on measures its cost directly: the wall time
spent inside the watch's calls (every `Monitor` method the loop calls, the check's sync
included) as a share of the loop's time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_step import bench_config, time_llmtrain
from rich.console import Console

from llmtrain.config.schema import Config
from llmtrain.data import prepare_data
from llmtrain.monitor.watch import Monitor

WATCH_CALLS = ("before_forward", "waited_for_data", "after_forward", "skip_check", "check", "after_step",
               "action_taken", "nonfinite")


def time_inside_the_watch(cfg: Config, warmup: int) -> tuple[float, float]:
    """(seconds per step inside the watch's calls, seconds per step of the loop) after `warmup`."""
    spent = [0.0]
    counting = [False]
    originals = {name: getattr(Monitor, name) for name in WATCH_CALLS}

    def timed(method: Callable) -> Callable:
        def call(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                if counting[0]:
                    spent[0] += time.perf_counter() - start

        return call

    def start_counting(self, step: int) -> None:  # noqa: ANN001
        counting[0] = step > warmup
        originals["before_forward"](self, step)

    try:
        for name, method in originals.items():
            setattr(Monitor, name, timed(method))
        Monitor.before_forward = timed(start_counting)
        per_step = time_llmtrain(cfg, warmup)
    finally:
        for name, method in originals.items():
            setattr(Monitor, name, method)
    return spent[0] / (cfg.max_steps - warmup), per_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    console = Console()
    times: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for enabled in (False, True):
                cfg = bench_config(Path(tmp) / f"run{rep}-{enabled}", args.steps, args.warmup, 16)
                cfg.monitor.enabled = enabled
                if rep == 0 and not enabled:
                    prepare_data(cfg.data, log=console.print)
                times[enabled].append(time_llmtrain(cfg, args.warmup))
            console.print(f"rep {rep + 1}: monitor off {times[False][-1] * 1e3:.1f} ms/step, "
                          f"on {times[True][-1] * 1e3:.1f} ms/step")
    off, on = statistics.median(times[False]), statistics.median(times[True])
    console.print(f"median ms/step: off {off * 1e3:.1f}, on {on * 1e3:.1f} (interval {cfg.monitor.interval}, "
                  f"activations every {cfg.monitor.activation_interval})")
    console.print(f"monitor overhead = [bold]{(on / off - 1) * 100:+.1f}%[/] (target <= 3%)")
    with tempfile.TemporaryDirectory() as tmp:
        inside, per_step = time_inside_the_watch(bench_config(Path(tmp) / "inside", args.steps, args.warmup, 16),
                                                 args.warmup)
    console.print(f"time inside the monitor's calls: {inside * 1e3:.2f} ms of {per_step * 1e3:.1f} ms per step = "
                  f"[bold]{inside / per_step:.1%}[/] of the loop (the direct measure; target <= 3%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
