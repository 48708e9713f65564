"""The performance harness (issue 9): llmtrain against a bare PyTorch loop on three model shapes.

    python benchmarks/harness.py                          # tiny, mid (6 x 384, context 256), gpt_small; 3 reps
    python benchmarks/harness.py --shapes tiny,mid --reps 5 --json perf.json
    python benchmarks/harness.py --startup-reps 5         # also: command -> first step of `llmtrain train`

For each shape and repetition, the bare loop and llmtrain's `train()` each run in a FRESH process
(alternating, so drift in the machine's speed hits both alike; peak memory is each loop's own).
Both use the same GPT module, prepared tokens, batch, fused AdamW with the same decay groups,
clipping at 1.0, fp32, threads and subnormals flushed to zero (as `llmtrain train` does before any
compute: a bare loop without it can run several times slower once values underflow, which would
flatter the ratio). llmtrain runs as a user runs it: the health monitor on at its
default interval (10), logging, the per-step finiteness check; evaluation and checkpoints off
(they are not the step). Timings cover the steps after the warm-up.

Reported per shape (medians over repetitions): s/step and tokens/s of each loop, their ratio
(target <= 1.03), MFU = model FLOPs per second (6N + attention, as the banner counts them) divided
by this machine's fp32 matmul peak measured in the same run (the best of 1024^2 .. 3072^2 square
matmuls; target >= 75% on mid), llmtrain's step split (data / forward / backward / optimizer /
other, from its `timing` records) and the peak RSS of each loop's process. The startup figure is
the wall time from launching `llmtrain train` (data already prepared) to the end of its first step
(target <= 3 s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import time_bare, time_llmtrain  # noqa: E402

from llmtrain.config.derived import seq_len_of
from llmtrain.config.schema import CompileMode, Config, ModelConfig
from llmtrain.data import prepare_data  # noqa: E402
from llmtrain.model import GPT  # noqa: E402
from llmtrain.model_tensors import model_tensors  # noqa: E402
from llmtrain.monitor.probes import peak_rss_mb

THREADS = 2
# name -> (model overrides, micro = global batch, steps, warm-up steps); log_interval = warm-up, so
# both ends of the timed window have a record, and the window holds the monitor's checks in proportion.
SHAPES: dict[str, tuple[dict, int, int, int]] = {
    "tiny": ({}, 16, 40, 10),
    "mid": ({"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256}, 8, 25, 5),
    "gpt_small": ({"name": "gpt_small", "n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024,
                   "vocab_size": 50304, "dropout": 0.0}, 1, 12, 2),
}


def shape_config(shape: str, out_dir: Path) -> Config:
    changes, micro, steps, warmup = SHAPES[shape]
    # compile off: the bare loop is eager, and this table measures the loop's own overhead (compile=auto
    # would follow a record of this machine's: benchmarks/bench_nanogpt.py measures compiling).
    cfg = Config(max_steps=steps, eval_interval=0, out_dir=str(out_dir), device="cpu", threads=THREADS, report=False,
                 compile=CompileMode.off)
    cfg.model = ModelConfig(**{**vars(ModelConfig()), **changes})
    cfg.micro_batch_size = cfg.global_batch_size = micro
    cfg.log_interval = warmup
    cfg.timing_interval = 2  # the split of many steps; timing costs nothing on a CPU
    cfg.schedule.warmup_steps = 2
    cfg.checkpoint.every_steps = cfg.checkpoint.every_minutes = None
    cfg.checkpoint.final = False
    return cfg


def matmul_peak() -> float:
    """The best fp32 matmul rate (FLOP/s) among a few square sizes, median of 5 each."""
    torch.set_num_threads(THREADS)
    best = 0.0
    for n in (1024, 2048, 3072):
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(2):
            a @ b
        times = []
        for _ in range(5):
            began = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - began)
        best = max(best, 2 * n**3 / statistics.median(times))
    return best


def one(shape: str, loop: str) -> dict:
    """One loop of one shape in this (fresh) process: seconds per step, peak RSS, the step split."""
    torch.set_flush_denormal(True)  # before any compute, as `llmtrain train` does; the bare loop too
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = shape_config(shape, Path(tmp) / "run")
        warmup = SHAPES[shape][3]
        if loop == "bare":
            seconds = time_bare(cfg, warmup)
            split = {}
        else:
            seconds = time_llmtrain(cfg, warmup)
            records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
            timed = [r for r in records if r["kind"] == "timing" and r["step"] > warmup]
            split = {p: statistics.median(r[f"{p}_s"] for r in timed) for p in
                     ("data", "forward", "backward", "optimizer", "other")}
        return {"seconds": seconds, "peak_rss_mb": peak_rss_mb(), "split": split}


def run_one(shape: str, loop: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--one", shape, loop], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{shape}/{loop} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def startup(reps: int) -> list[float]:
    """Seconds from launching `llmtrain train` (the default config, data prepared) to the end of step 1."""
    results = []
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as tmp:
            began = time.time()
            proc = subprocess.run([sys.executable, "-m", "llmtrain", "train", "max_steps=1", "log_interval=1",
                                   "eval_interval=0", "report=false", "checkpoint.final=false",
                                   f"hydra.run.dir={tmp}/run"], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-3000:])
            records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
            start = next(r for r in records if r["kind"] == "start")
            first = next(r for r in records if r["kind"] == "train")
            results.append(start["time"] + first["elapsed_s"] - began)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,mid,gpt_small", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--startup-reps", type=int, default=3, help="0 skips the startup measurement")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--one", nargs=2, metavar=("SHAPE", "LOOP"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(*args.one)))
        return 0
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}; valid: {', '.join(SHAPES)}")
    console = Console(width=max(Console().width, 170))  # the table is wide; a pipe gets 80 columns otherwise
    prepare_data(Config().data, log=console.print)  # once, outside every timing
    peak = matmul_peak()
    console.print(f"fp32 matmul peak, {THREADS} threads: {peak / 1e9:,.0f} GFLOP/s")
    figures: dict = {"matmul_peak_flops": peak, "threads": THREADS, "torch": torch.__version__, "shapes": {}}
    for shape in shapes:
        runs: dict[str, list[dict]] = {"bare": [], "llmtrain": []}
        for rep in range(args.reps):
            for loop in ("bare", "llmtrain"):
                runs[loop].append(run_one(shape, loop))
            console.print(f"{shape} rep {rep + 1}/{args.reps}: bare {runs['bare'][-1]['seconds'] * 1e3:,.1f} ms/step, "
                          f"llmtrain {runs['llmtrain'][-1]['seconds'] * 1e3:,.1f} ms/step")
        cfg = shape_config(shape, Path("unused"))
        model = GPT(cfg.model, cfg.model.vocab_size or 256)
        tokens_per_step = cfg.global_batch_size * seq_len_of(cfg)
        flops_step = model_tensors(model.cfg, model.vocab_size).flops_per_token(seq_len_of(cfg)) * tokens_per_step
        bare = statistics.median(r["seconds"] for r in runs["bare"])
        ours = statistics.median(r["seconds"] for r in runs["llmtrain"])
        split = {p: statistics.median(r["split"][p] for r in runs["llmtrain"]) for p in runs["llmtrain"][0]["split"]}
        figures["shapes"][shape] = {
            "params": sum(p.numel() for p in model.parameters()), "tokens_per_step": tokens_per_step,
            "flops_per_step": flops_step, "bare_s": bare, "llmtrain_s": ours, "ratio": ours / bare,
            "mfu_bare": flops_step / bare / peak, "mfu_llmtrain": flops_step / ours / peak,
            "peak_rss_mb_bare": statistics.median(r["peak_rss_mb"] for r in runs["bare"]),
            "peak_rss_mb_llmtrain": statistics.median(r["peak_rss_mb"] for r in runs["llmtrain"]),
            "split_s": split, "all": runs,
        }
    table = Table(title=f"llmtrain vs a bare PyTorch loop: fp32, {THREADS} threads, medians of {args.reps} reps; "
                  f"MFU against {peak / 1e9:,.0f} GFLOP/s (measured matmul peak)")
    for column in ("shape", "tokens/step", "bare ms/step", "llmtrain ms/step", "ratio", "tokens/s", "MFU",
                   "split: data/fwd/bwd/opt/other", "peak RSS bare / llmtrain"):
        table.add_column(column)
    for shape, f in figures["shapes"].items():
        total = sum(f["split_s"].values()) or 1.0
        split = " / ".join(f"{100 * v / total:.0f}%" for v in f["split_s"].values())
        table.add_row(shape, f"{f['tokens_per_step']:,}", f"{f['bare_s'] * 1e3:,.1f}", f"{f['llmtrain_s'] * 1e3:,.1f}",
                      f"{f['ratio']:.3f}", f"{f['tokens_per_step'] / f['llmtrain_s']:,.0f}", f"{f['mfu_llmtrain']:.0%}",
                      split, f"{f['peak_rss_mb_bare']:,.0f} / {f['peak_rss_mb_llmtrain']:,.0f} MB")
    console.print(table)
    if args.startup_reps:
        times = startup(args.startup_reps)
        figures["startup_s"] = times
        console.print(f"command -> end of step 1 (`llmtrain train`, default config, data prepared): median "
                      f"{statistics.median(times):.2f} s over {len(times)} "
                      f"(all: {', '.join(f'{t:.2f}' for t in times)}; "
                      "target <= 3 s)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
