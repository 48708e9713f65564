"""The scaling report (issue 37): how llmtrain's cost grows with the work, against a bare loop.

    python benchmarks/scaling.py                                   # the full report: 13 points, ~6 min on 2 cores
    python benchmarks/scaling.py --quick                           # 8 points, shorter timings: ~1.5 min
    python benchmarks/scaling.py --json scaling.json --plot docs/img/scaling.png   # + docs/img/scaling-memory.png
    python benchmarks/scaling.py --axes context,processes --reps 3 --cores 2
    python benchmarks/scaling.py --from-json scaling.json --markdown --plot docs/img/scaling.png   # no measuring

Four sweeps, each varying one axis of a base shape (gpt_tiny, context 256, micro-batch 4, one
process) and holding the others:

- model:     gpt_tiny (4 x 128), mid (6 x 384), gpt_small (12 x 768), at context 256, micro-batch 4;
- context:   64, 128, 256, 512, 1024 tokens, gpt_tiny, micro-batch 4;
- micro:     1, 2, 4, 8, 16 sequences per step, gpt_tiny, context 256 (no accumulation);
- processes: 1, 2, 4 processes, DDP over gloo, weak scaling (micro-batch 4 per process, so the global
  batch grows with them), gpt_tiny, context 256.

Every point runs the two loops of benchmarks/harness.py, each in a fresh process (N processes under
torch.distributed.run for the processes axis; `peaks.run_ranks` starts them and records each
process's peak RSS, VmHWM): llmtrain's real `train()` (monitor on at its default interval, logging,
the finiteness check; evaluation, checkpoints and the report off) and the bare nanoGPT-style loop of
benchmarks/bench_step.py (same GPT, prepared tokens, fused AdamW with the same decay groups, clipping,
fp32, threads, subnormals flushed). With several processes the bare loop is the same loop wrapped in
torch's DistributedDataParallel by hand (gloo, each rank its own batches). A point's base shape is
measured once and shared by the axes that hold it.

Reported per point: tokens/s of each loop (all processes together; per process too on the processes
axis), the time ratio llmtrain / bare (s/step; 1.03 = llmtrain 3% slower), MFU of each loop (model
FLOPs per second, 6N + attention as the banner counts them, over the ceiling: harness.matmul_peak
measured at the start of the run with all the cores and with 1 thread, the higher; measured again at
the end, with a warning when the two differ by more than 15% or a point's MFU passes 100%), and the
peak RSS of each loop's process (the largest of its processes). Threads: cores // processes per
process, at least 1; where processes x threads exceed the cores (4 processes on 2 cores) the report
says the point is oversubscribed. Steps per point follow its cost: enough to fill a few seconds of
timed steps, 3 to 10 warm-up steps (untimed; log_interval = warm-up, so both ends of the timed
window have a record) and 5 to 40 timed ones. A failed point is reported as failed, the others still
run, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.markup import escape
from rich.table import Table

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
import harness  # noqa: E402 - benchmarks/ is not a package
from bench_step import time_bare, time_llmtrain  # noqa: E402
from peaks import run_ranks  # noqa: E402

from llmtrain.config.derived import effective_lr, model_vocab_size  # noqa: E402
from llmtrain.config.schema import Config, ModelConfig, ParallelConfig  # noqa: E402
from llmtrain.data import prepare_data  # noqa: E402
from llmtrain.distributed.cores import usable_cores  # noqa: E402
from llmtrain.model import GPT  # noqa: E402
from llmtrain.model_tensors import model_tensors  # noqa: E402

MODELS: dict[str, dict] = {
    "gpt_tiny": {},  # ModelConfig's defaults: 4 layers, 4 heads, width 128
    "mid": {"name": "mid", "n_layer": 6, "n_head": 6, "n_embd": 384},
    "gpt_small": {"name": "gpt_small", "n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_multiple": 64},
}


@dataclass(frozen=True)
class Point:
    model: str = "gpt_tiny"
    context: int = 256
    micro: int = 4  # sequences per process per step (global batch = micro x processes: no accumulation)
    processes: int = 1

    @property
    def tokens_per_step(self) -> int:
        return self.micro * self.context * self.processes


BASE = Point()
AXES: dict[str, tuple[str, str]] = {  # axis -> (Point field, label)
    "model": ("model", "model size"),
    "context": ("context", "context (tokens)"),
    "micro": ("micro", "micro-batch (sequences)"),
    "processes": ("processes", "processes (DDP, gloo)"),
}
FULL: dict[str, list] = {"model": ["gpt_tiny", "mid", "gpt_small"], "context": [64, 128, 256, 512, 1024],
                         "micro": [1, 2, 4, 8, 16], "processes": [1, 2, 4]}
QUICK: dict[str, list] = {"model": ["gpt_tiny", "mid"], "context": [64, 256, 1024], "micro": [1, 4, 16],
                          "processes": [1, 2, 4]}  # 8 points: each axis's ends and the base
TIMED_SECONDS = {"full": 3.0, "quick": 1.0}  # wall time of the timed steps each loop aims for


def point_config(point: Point, out_dir: Path, steps: int, warmup: int, threads: int) -> Config:
    """harness.shape_config's run (fp32 CPU, monitor on, no eval/checkpoints/report) for any point."""
    cfg = Config(max_steps=steps, eval_interval=0, out_dir=str(out_dir), device="cpu", threads=threads, report=False)
    cfg.model = ModelConfig(**{**vars(ModelConfig()), **MODELS[point.model], "block_size": point.context})
    cfg.micro_batch_size = point.micro
    cfg.global_batch_size = point.micro * point.processes
    cfg.log_interval = warmup
    cfg.schedule.warmup_steps = 2
    cfg.checkpoint.every_steps = cfg.checkpoint.every_minutes = None
    cfg.checkpoint.final = False
    if point.processes > 1:
        cfg.parallel = ParallelConfig(dp_replicate=-1)  # the ddp preset: one replica per process
    return cfg


def matmul_peaks(cores: int) -> dict[int, float]:
    """harness.matmul_peak with all the cores and with one (a process at 1 thread): FLOP/s by threads."""
    peaks = {}
    for threads in sorted({1, cores}):
        harness.THREADS = threads
        peaks[threads] = harness.matmul_peak()
    return peaks


def threads_for(processes: int, cores: int) -> int:
    return max(1, cores // processes)


# ---------------------------------------------------------------------------------------------
# One loop of one point, in this (fresh) process: one of the ranks under torch.distributed.run
# ---------------------------------------------------------------------------------------------


def time_bare_ddp(cfg: Config, warmup: int) -> float:
    """bench_step.time_bare with several processes: the same loop, the model in torch's
    DistributedDataParallel over gloo (as a careful user writes it by hand), each rank drawing its own
    batches; one process: time_bare itself."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return time_bare(cfg, warmup)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    data = prepare_data(cfg.data, log=lambda _: None)
    tokens = data.tokens("train")
    seq_len, micro = cfg.model.block_size, cfg.micro_batch_size
    accum = cfg.global_batch_size // (micro * world)
    rng = np.random.default_rng(cfg.seed + rank)
    offsets = np.arange(seq_len + 1)
    vocab = model_vocab_size(cfg, data.vocab_size)
    model = DistributedDataParallel(GPT(cfg.model, vocab))
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=effective_lr(cfg), betas=(cfg.optim.beta1, cfg.optim.beta2), fused=True,
    )
    start = 0.0
    for step in range(cfg.max_steps):
        if step == warmup:
            start = time.perf_counter()
        for micro_step in range(accum):
            starts = rng.integers(0, tokens.size - seq_len, size=micro)
            window = torch.from_numpy(tokens[starts[:, None] + offsets].astype(np.int64))
            x, y = window[:, :-1], window[:, 1:]
            with model.no_sync() if micro_step < accum - 1 else nullcontext():  # all-reduce once per window
                loss = F.cross_entropy(model(x).view(-1, vocab), y.reshape(-1)) / accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.clip_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % cfg.log_interval == 0:
            loss.item()
    seconds = (time.perf_counter() - start) / (cfg.max_steps - warmup)
    dist.barrier()
    dist.destroy_process_group()
    return seconds


def measure(args: dict) -> dict:
    """One loop of one point in this process (one rank): seconds per timed step."""
    torch.set_flush_denormal(True)  # before any compute, as `llmtrain train` does; the bare loop too
    torch.set_num_threads(args["threads"])
    point = Point(**args["point"])
    cfg = point_config(point, Path(args["out"]) / "run", args["steps"], args["warmup"], args["threads"])
    if args["loop"] == "bare":
        seconds = time_bare_ddp(cfg, args["warmup"])
    else:
        seconds = time_llmtrain(cfg, args["warmup"])  # reads rank 0's metrics.jsonl (one run dir)
    return {"seconds": seconds, "threads": torch.get_num_threads()}


# `peaks.RECORD_PEAK` is appended: it writes `predicted` (here: what `measure` returned) with the
# process's VmHWM to OUT/peak<rank>.json.
_RANK_SCRIPT = f"""
import json, os, sys
sys.path.insert(0, {str(BENCHMARKS)!r})
from scaling import measure

args = json.loads(sys.argv[1])
predicted = measure(args)
"""


def run_loop(point: Point, loop: str, steps: int, warmup: int, threads: int) -> dict:
    """`loop` at `point` in fresh processes: rank 0's seconds per step, each process's peak RSS."""
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="scaling_") as tmp:
        payload = {"point": asdict(point), "loop": loop, "steps": steps, "warmup": warmup, "threads": threads,
                   "out": tmp}
        ranks = run_ranks(_RANK_SCRIPT, payload, point.processes, Path(tmp))
    if isinstance(ranks, str):
        raise RuntimeError(f"{point} / {loop} failed: {ranks}")
    return {"seconds": ranks[0]["predicted"]["seconds"], "threads": ranks[0]["predicted"]["threads"],
            "peak_rss_mb": [r["measured"] / 2**20 for r in ranks], "wall_s": time.perf_counter() - began}


# ---------------------------------------------------------------------------------------------
# The sweeps
# ---------------------------------------------------------------------------------------------


def model_facts(point: Point, vocab: int) -> dict:
    cfg = point_config(point, Path("unused"), 2, 1, 1)
    tensors = model_tensors(cfg.model, model_vocab_size(cfg, vocab))
    flops_per_step = tensors.flops_per_token(point.context) * point.tokens_per_step
    return {"params": tensors.n_params, "flops_per_step": flops_per_step}


def steps_for(flops_per_step: float, peak: float, timed_seconds: float) -> tuple[int, int]:
    """(warm-up, timed) steps: the timed ones fill about `timed_seconds`, guessing a step from two
    thirds of the peak plus a few ms of fixed cost."""
    guess = flops_per_step / (peak / 1.5) + 0.005
    timed = min(40, max(5, math.ceil(timed_seconds / guess)))
    warmup = min(10, max(3, math.ceil(timed_seconds / 3 / guess)))
    return warmup, timed


def measure_point(point: Point, vocab: int, peak: float, cores: int, reps: int, timed_seconds: float,
                  log) -> dict:
    facts = model_facts(point, vocab)
    warmup, timed = steps_for(facts["flops_per_step"], peak, timed_seconds)
    threads = threads_for(point.processes, cores)
    load = os.getloadavg()[0]
    tokens = point.tokens_per_step
    result = {
        "point": asdict(point), **facts, "tokens_per_step": tokens, "warmup_steps": warmup, "timed_steps": timed,
        "threads_per_process": threads, "oversubscribed": point.processes * threads > cores, "load_average": load,
    }
    runs: dict[str, list[dict]] = {"bare": [], "llmtrain": []}
    try:
        for rep in range(reps):
            for loop in ("bare", "llmtrain") if rep % 2 == 0 else ("llmtrain", "bare"):  # drift hits both alike
                runs[loop].append(run_loop(point, loop, warmup + timed, warmup, threads))
    except RuntimeError as err:  # one failed point does not end a 15-minute report: it is reported as failed
        log(f"[red]{describe(point)}: failed[/] {escape(str(err))}")
        return {**result, "error": str(err)}
    seconds = {loop: statistics.median(r["seconds"] for r in rs) for loop, rs in runs.items()}
    result.update(ratio=seconds["llmtrain"] / seconds["bare"], all=runs)
    for loop, s in seconds.items():
        result[f"{loop}_s"] = s
        result[f"{loop}_tokens_per_s"] = tokens / s
        result[f"{loop}_tokens_per_s_per_process"] = tokens / s / point.processes
        result[f"{loop}_mfu"] = facts["flops_per_step"] / s / peak
        result[f"{loop}_peak_rss_mb"] = statistics.median(max(r["peak_rss_mb"]) for r in runs[loop])
    log(f"{describe(point)}: {warmup}+{timed} steps, {threads} thread(s)/process, load {load:.1f}; bare "
        f"{result['bare_tokens_per_s']:,.0f} tok/s, llmtrain {result['llmtrain_tokens_per_s']:,.0f} tok/s, "
        f"ratio {result['ratio']:.3f}")
    return result


def describe(point: Point) -> str:
    return f"{point.model} ctx {point.context} micro {point.micro} x {point.processes} proc"


def axis_points(axis: str, values: list) -> list[Point]:
    return [replace(BASE, **{AXES[axis][0]: v}) for v in values]


def report_table(axis: str, results: list[dict], peak: float, cores: int) -> Table:
    field, label = AXES[axis]
    table = Table(title=f"{label}: llmtrain vs a bare loop (base: {describe(BASE)}); "
                  f"MFU against {peak / 1e9:,.0f} GFLOP/s (the fp32 matmul peak measured at the start)")
    columns = [label, "params", "tokens/step", "threads", "bare tok/s", "llmtrain tok/s", "ratio (s/step)",
               "MFU bare / llmtrain", "peak RSS bare / llmtrain"]
    if axis == "processes":
        columns[6:6] = ["tok/s per proc bare / llmtrain", "speed-up vs 1 proc bare / llmtrain"]
    for column in columns:
        table.add_column(column, justify="left" if column == label else "right")
    first = results[0]
    for r in results:
        row = [str(r["point"][field]), f"{r['params'] / 1e6:,.1f}M", f"{r['tokens_per_step']:,}",
               f"{r['threads_per_process']}" + (" (over)" if r["oversubscribed"] else "")]
        if "error" in r:
            table.add_row(*row, "failed", *[""] * (len(columns) - len(row) - 1))
            continue
        row += [f"{r['bare_tokens_per_s']:,.0f}", f"{r['llmtrain_tokens_per_s']:,.0f}", f"{r['ratio']:.3f}",
               f"{r['bare_mfu']:.0%} / {r['llmtrain_mfu']:.0%}",
               f"{r['bare_peak_rss_mb']:,.0f} / {r['llmtrain_peak_rss_mb']:,.0f} MB"]
        if axis == "processes":
            speedup = "" if "error" in first else (
                f"{r['bare_tokens_per_s'] / first['bare_tokens_per_s']:.2f}x / "
                f"{r['llmtrain_tokens_per_s'] / first['llmtrain_tokens_per_s']:.2f}x")
            row[6:6] = [f"{r['bare_tokens_per_s_per_process']:,.0f} / {r['llmtrain_tokens_per_s_per_process']:,.0f}",
                        speedup]
        table.add_row(*row)
    return table


def markdown_table(figures: dict) -> str:
    """Every axis in one markdown table, as docs/performance.md shows the report."""
    lines = ["| axis | point | params | tokens/step | threads/process | bare tokens/s | llmtrain tokens/s | "
             "ratio (s/step) | MFU bare / llmtrain | peak RSS bare / llmtrain |", "|" + "---|" * 10]
    for axis, results in figures["axes"].items():
        field = AXES[axis][0]
        for r in results:
            head = [axis, str(r["point"][field]), f"{r['params'] / 1e6:,.2f}M", f"{r['tokens_per_step']:,}",
                    f"{r['threads_per_process']}" + (" (oversubscribed)" if r["oversubscribed"] else "")]
            if "error" in r:
                lines.append("| " + " | ".join([*head, "failed", "", "", "", ""]) + " |")
                continue
            speeds = [f"{r[f'{loop}_tokens_per_s']:,.0f}" + (
                f" ({r[f'{loop}_tokens_per_s_per_process']:,.0f}/process)" if r["point"]["processes"] > 1 else "")
                for loop in ("bare", "llmtrain")]
            lines.append("| " + " | ".join([
                *head, *speeds, f"{r['ratio']:.3f}", f"{r['bare_mfu']:.0%} / {r['llmtrain_mfu']:.0%}",
                f"{r['bare_peak_rss_mb']:,.0f} / {r['llmtrain_peak_rss_mb']:,.0f} MB"]) + " |")
    return "\n".join(lines)


def plot(figures: dict, path: Path) -> list[Path]:
    """A 2x2 figure of tokens/s (both loops; log scale for model size, which spans orders of
    magnitude) and the ratio per axis; a second one, <stem>-memory.png, of the peak RSS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda value, _: f"{value:,.0f}")

    axes_done = [a for a in AXES if a in figures["axes"]]
    written = []
    for kind in ("speed", "memory"):
        fig, grid = plt.subplots(2, 2, figsize=(11, 8))
        for ax, axis in zip(grid.flat, axes_done, strict=False):
            results = [r for r in figures["axes"][axis] if "error" not in r]
            field, label = AXES[axis]
            xs = list(range(len(results)))
            ticks = [str(r["point"][field]) for r in results]
            if kind == "speed":
                for loop, style in (("bare", "o--"), ("llmtrain", "s-")):
                    ax.plot(xs, [r[f"{loop}_tokens_per_s"] for r in results], style, label=f"{loop} tokens/s")
                if axis == "model":
                    ax.set_yscale("log")
                    ax.yaxis.set_minor_formatter(NullFormatter())
                else:
                    ax.set_ylim(bottom=0, top=1.15 * max((r[f"{lp}_tokens_per_s"] for r in results
                                                          for lp in ("bare", "llmtrain")), default=1))
                ax.yaxis.set_major_formatter(plain)
                ax.set_ylabel("tokens/s (all processes)")
                twin = ax.twinx()
                twin.plot(xs, [r["ratio"] for r in results], "^:", color="tab:red", label="ratio llmtrain/bare")
                twin.axhline(1.0, color="tab:red", linewidth=0.5)
                low = min(0.9, *(r["ratio"] for r in results))
                high = max(1.1, *(r["ratio"] for r in results))
                twin.set_ylim(low - 0.02, high + 0.02)
                twin.set_ylabel("s/step ratio llmtrain / bare", color="tab:red")
                lines = ax.get_legend_handles_labels()
                more = twin.get_legend_handles_labels()
                ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower left")
            else:
                for loop, style in (("bare", "o--"), ("llmtrain", "s-")):
                    ax.plot(xs, [r[f"{loop}_peak_rss_mb"] for r in results], style, label=f"{loop} peak RSS")
                ax.set_ylim(bottom=0, top=1.15 * max((r[f"{lp}_peak_rss_mb"] for r in results
                                                      for lp in ("bare", "llmtrain")), default=1))
                ax.yaxis.set_major_formatter(plain)
                ax.set_ylabel("peak RSS per process (MB)")
                ax.legend(fontsize=8, loc="lower right")
            ax.set_xticks(xs, ticks)
            ax.set_xlabel(label)
            ax.grid(True, alpha=0.3)
        for ax in list(grid.flat)[len(axes_done):]:
            ax.set_visible(False)
        what = "throughput" if kind == "speed" else "peak resident memory"
        fig.suptitle(f"llmtrain vs a bare loop: {what} (fp32 CPU, {figures['cores']} cores, "
                     f"matmul peak {figures['matmul_peak_flops'] / 1e9:,.0f} GFLOP/s){figures['label']}", fontsize=10)
        fig.tight_layout()
        out = path if kind == "speed" else path.with_name(f"{path.stem}-memory{path.suffix}")
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few points per axis and shorter timings (< 3 min)")
    parser.add_argument("--axes", default=",".join(AXES), help="comma-separated: " + ", ".join(AXES))
    parser.add_argument("--reps", type=int, default=1, help="repetitions per point (medians; the loops alternate)")
    parser.add_argument("--cores", type=int, help="cores to use (threads = cores // processes); default: all this "
                        "process may use (its affinity, capped by a cgroup quota)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--plot", type=Path, help="write the 2x2 figure here (and <stem>-memory.png beside it)")
    parser.add_argument("--from-json", type=Path, help="measure nothing: the tables (and --plot) of a saved --json")
    parser.add_argument("--markdown", action="store_true", help="also print the figures as one markdown table")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 170))
    if args.from_json:
        figures = json.loads(args.from_json.read_text())
        for axis, results in figures["axes"].items():
            console.print(report_table(axis, results, figures["matmul_peak_flops"], figures["cores"]))
        if args.markdown:
            print(markdown_table(figures))
        for path in plot(figures, args.plot) if args.plot else []:
            console.print(f"wrote {path}")
        return 0
    axes = [a for a in args.axes.split(",") if a]
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        parser.error(f"unknown axis/axes {', '.join(unknown)}; valid: {', '.join(AXES)}")
    began = time.perf_counter()
    mode = "quick" if args.quick else "full"
    values = QUICK if args.quick else FULL
    cores = args.cores or usable_cores()
    load = os.getloadavg()[0]
    data = prepare_data(Config().data, log=console.print)  # once, outside every timing
    peaks = matmul_peaks(cores)
    peak = max(peaks.values())  # the ceiling: the best rate the machine's matmul reached
    console.print("fp32 matmul peak: " + ", ".join(f"{v / 1e9:,.0f} GFLOP/s with {t} thread(s)" for t, v in
                                                   peaks.items())
                  + f"; the ceiling (MFU's denominator): {peak / 1e9:,.0f} (load average {load:.2f} at start)")
    if load > 0.5:
        console.print(f"[yellow]the machine is busy (load average {load:.2f}): the figures will be noisy, and points "
                      "with as many threads as cores the most (a thread whose core another process holds stalls the "
                      "others: see llmtrain/distributed/cores.py); a quiet machine gives the report's figures[/]")
    if "processes" in axes:
        over = [n for n in values["processes"] if n * threads_for(n, cores) > cores]
        console.print(f"threads per process = {cores} cores // processes, at least 1"
                      + (f"; {', '.join(map(str, over))} processes oversubscribe the {cores} cores "
                         "(1 thread each, more processes than cores)" if over else ""))
    label = f" [{'quick run, ' if args.quick else ''}load average {load:.1f} at start]"
    figures: dict = {"mode": mode, "label": label, "cores": cores,
                     "matmul_peak_flops": peak, "matmul_peak_flops_by_threads": peaks, "torch": torch.__version__,
                     "reps": args.reps, "load_average_start": load, "base": asdict(BASE), "axes": {}}
    done: dict[Point, dict] = {}
    for axis in axes:
        results = []
        for point in axis_points(axis, values[axis]):
            if point not in done:
                done[point] = measure_point(point, data.vocab_size, peak, cores, args.reps, TIMED_SECONDS[mode],
                                            console.print)
            results.append(done[point])
        figures["axes"][axis] = results
    for axis in axes:
        console.print(report_table(axis, figures["axes"][axis], peak, cores))
    end_peak = max(matmul_peaks(cores).values())
    figures["matmul_peak_flops_end"] = end_peak
    beyond = [f"{describe(p)} ({max(r['bare_mfu'], r['llmtrain_mfu']):.0%})" for p, r in done.items()
              if "error" not in r and max(r["bare_mfu"], r["llmtrain_mfu"]) > 1]
    if beyond or not 0.85 < end_peak / peak < 1.15:
        console.print(f"[yellow]the ceiling moved: {peak / 1e9:,.0f} GFLOP/s at the start, {end_peak / 1e9:,.0f} "
                      "at the end" + (f"; MFU above 100% at {', '.join(beyond)}" if beyond else "")
                      + ": the start's peak was measured in a busier (or quieter) moment than the points; MFU is "
                      "against it[/]")
    if args.markdown:
        print(markdown_table(figures))
    figures["wall_s"] = time.perf_counter() - began
    figures["load_average_end"] = os.getloadavg()[0]
    console.print(f"{mode} report: {len(done)} points, {figures['wall_s']:.0f} s wall; load average "
                  f"{load:.2f} at start, {figures['load_average_end']:.2f} at the end (other work on the machine "
                  "makes the figures noisy)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    if args.plot:
        for path in plot(figures, args.plot):
            console.print(f"wrote {path}")
    failed = [describe(p) for p, r in done.items() if "error" in r]
    if failed:
        console.print(f"[red]{len(failed)} point(s) failed[/]: {'; '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
