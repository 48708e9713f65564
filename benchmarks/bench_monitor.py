"""The health monitor's cost: llmtrain's step time with the monitor on (default interval) and off.

    python benchmarks/bench_monitor.py [--steps 60] [--warmup 10] [--reps 3]

Both configurations run the real `train()` on the default model and data, alternating in one
process; each timing covers the steps after `--warmup`. Reported: median ms/step of each and the
overhead of the monitor (target <= 3%).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from bench_step import bench_config, time_llmtrain
from rich.console import Console

from llmtrain.data import prepare_data


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
