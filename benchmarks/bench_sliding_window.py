"""Sliding-window attention's cost: a training step (forward and backward; --eval: a forward only)
of one model shape with full causal attention, with model.sliding_window and its mask cached
(llmtrain's path: one mask per length and device, shared by every layer), and with the mask rebuilt
by every layer of every forward (the cache emptied before each attention call), which is what the
cache saves.

    python benchmarks/bench_sliding_window.py [--seq-len 256 1024] [--window 64] [--layers 4] [--width 128]
                                              [--batch 8] [--reps 5] [--threads 1] [--eval] [--json out.json]

Medians of --reps timed steps after one untimed warm-up, interleaved (full, cached, rebuilt, full,
...) so drift in the machine's speed hits all three alike; CPU unless CUDA is there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from llmtrain import model as gpt
from llmtrain.config.schema import ModelConfig


def step_seconds(net: gpt.GPT, idx: torch.Tensor, rebuild: bool, forward_only: bool) -> float:
    """One forward and backward of `net` on `idx` (its mean logit as the loss), or with `forward_only`
    one forward without autograd (evaluation), in seconds."""
    original = gpt.band_mask

    def rebuilt(*args: Any) -> torch.Tensor:
        gpt._BAND_MASKS.clear()
        return original(*args)

    if rebuild:
        gpt.band_mask = rebuilt
    try:
        _sync(idx.device)
        start = time.perf_counter()
        if forward_only:
            with torch.no_grad():
                net(idx)
        else:
            net(idx).float().mean().backward()
        _sync(idx.device)
        return time.perf_counter() - start
    finally:
        gpt.band_mask = original
        net.zero_grad(set_to_none=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eval", action="store_true", help="time a forward without autograd instead of a step")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    for seq_len in args.seq_len:
        shape = {"n_layer": args.layers, "n_head": 4, "n_embd": args.width, "block_size": seq_len}
        torch.manual_seed(0)
        full = gpt.GPT(ModelConfig(**shape), 256).to(device)
        windowed = gpt.GPT(ModelConfig(**shape, sliding_window=args.window), 256).to(device)
        windowed.load_state_dict(full.state_dict())
        idx = torch.randint(0, 256, (args.batch, seq_len), device=device)
        cases = {"full": (full, False), "window_cached": (windowed, False), "window_rebuilt": (windowed, True)}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for net, rebuild in cases.values():
            step_seconds(net, idx, rebuild, args.eval)  # warm-up
        for _ in range(args.reps):
            for name, (net, rebuild) in cases.items():
                times[name].append(step_seconds(net, idx, rebuild, args.eval))
        row = {"seq_len": seq_len, "window": args.window, **{f"{k}_ms": 1e3 * statistics.median(v)
                                                               for k, v in times.items()}}
        results.append(row)
        what = "eval forward" if args.eval else "training step"
        print(f"{what}, T={seq_len} window={args.window}: full causal {row['full_ms']:.1f} ms, window (mask cached) "
              f"{row['window_cached_ms']:.1f} ms, window (mask per layer) {row['window_rebuilt_ms']:.1f} ms "
              f"[{device.type}, {args.threads} thread(s), batch {args.batch}, {args.layers} layers x {args.width}]")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
