"""llmtrain's train step against a bare PyTorch loop: same model, batch, optimizer, data, threads.

    python benchmarks/bench_step.py [--steps 40] [--warmup 10] [--reps 3] [--global-batch-size 16]

Both loops run in this process, alternating (bare, llmtrain, bare, llmtrain, ...) so drift in the
machine's speed hits both alike. Each timing covers the steps after `--warmup` (allocator and
kernel warm-up excluded) up to the last one, including llmtrain's logging syncs. Reported: median
seconds per step of each and the ratio llmtrain / bare (target <= 1.05).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from llmtrain.config.derived import accumulation_steps, effective_lr, model_vocab_size, seq_len_of
from llmtrain.config.schema import CompileMode, Config
from llmtrain.config.validate import validate
from llmtrain.data import prepare_data
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.model import GPT
from llmtrain.training.loop import train


def bench_config(out_dir: Path, steps: int, warmup: int, global_batch_size: int) -> Config:
    """The default `llmtrain train` config (gpt_tiny, byte stdlib data, AdamW fused, fp32, 2 threads)."""
    cfg = Config(max_steps=steps, eval_interval=0, out_dir=str(out_dir), device="cpu", threads=2,
                 compile=CompileMode.off)  # the bare loop is eager: the loop's overhead, not compiling, is measured
    cfg.global_batch_size = global_batch_size  # > micro_batch_size (16) exercises accumulation
    cfg.log_interval = warmup  # a log record (and its host sync) at the warm-up boundary, then every `warmup` steps
    cfg.schedule.warmup_steps = 2
    validate(cfg)  # as train() does: fills in the derived values (optim.lr=null follows the width)
    return cfg


def time_llmtrain(cfg: Config, warmup: int) -> float:
    """Seconds per step after warm-up, read from the run's own metrics.jsonl timestamps."""
    result = train(cfg, console=Dashboard(cfg.max_steps, Console(quiet=True)))
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed = {r["step"]: r["elapsed_s"] for r in records if r["kind"] == "train"}
    return (elapsed[cfg.max_steps] - elapsed[warmup]) / (cfg.max_steps - warmup)


def time_bare(cfg: Config, warmup: int) -> float:
    """The loop a careful user would write by hand (nanoGPT style), on the same prepared tokens."""
    torch.manual_seed(cfg.seed)
    data = prepare_data(cfg.data, log=lambda _: None)
    tokens = data.tokens("train")
    seq_len, micro = seq_len_of(cfg), cfg.micro_batch_size
    accum = accumulation_steps(cfg)
    rng = np.random.default_rng(cfg.seed)
    offsets = np.arange(seq_len + 1)
    vocab = model_vocab_size(cfg, data.vocab_size)  # as train() sizes it (gpt_small pads to a multiple of 64)
    model = GPT(cfg.model, vocab)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=effective_lr(cfg), betas=(cfg.optim.beta1, cfg.optim.beta2), fused=True,
    )
    start = 0.0
    for step in range(cfg.max_steps):
        if step == warmup:
            start = time.perf_counter()
        for _ in range(accum):
            starts = rng.integers(0, tokens.size - seq_len, size=micro)
            window = torch.from_numpy(tokens[starts[:, None] + offsets].astype(np.int64))
            x, y = window[:, :-1], window[:, 1:]
            loss = F.cross_entropy(model(x).view(-1, vocab), y.reshape(-1)) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % cfg.log_interval == 0:
            loss.item()  # a hand-written loop prints its loss now and then too
    return (time.perf_counter() - start) / (cfg.max_steps - warmup)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=16, help="sequences per step (micro-batch is 16)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    torch.set_flush_denormal(True)  # both loops, before any compute (as `llmtrain train` does)
    torch.set_num_threads(2)
    console = Console()
    bare, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = bench_config(Path(tmp) / "run", args.steps, args.warmup, args.global_batch_size)
        prepare_data(cfg.data, log=console.print)
        for rep in range(args.reps):
            bare.append(time_bare(cfg, args.warmup))
            cfg.out_dir = str(Path(tmp) / f"run{rep}")
            ours.append(time_llmtrain(cfg, args.warmup))
            console.print(f"rep {rep + 1}/{args.reps}: bare {bare[-1] * 1e3:.1f} ms/step, "
                          f"llmtrain {ours[-1] * 1e3:.1f} ms/step")
    tokens_per_step = cfg.global_batch_size * seq_len_of(cfg)
    b, o = statistics.median(bare), statistics.median(ours)
    accum = accumulation_steps(cfg)
    table = Table(
        title=f"train step: {cfg.model.name}, {tokens_per_step:,} tokens/step "
        f"({accum} x {cfg.micro_batch_size} sequences), "
        f"fp32, {torch.get_num_threads()} threads"
    )
    for col in ("loop", "median ms/step", "tokens/s", "all reps (ms)"):
        table.add_column(col)
    for name, seconds, reps in (("bare PyTorch", b, bare), ("llmtrain", o, ours)):
        table.add_row(name, f"{seconds * 1e3:.1f}", f"{tokens_per_step / seconds:,.0f}",
                      ", ".join(f"{t * 1e3:.1f}" for t in reps))
    console.print(table)
    ratio = o / b
    console.print(f"ratio llmtrain / bare = [bold]{ratio:.3f}[/] (target <= 1.05)")
    if args.json:
        args.json.write_text(json.dumps({"bare_s": bare, "llmtrain_s": ours, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
