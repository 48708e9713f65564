"""Where a train step's time goes, op by op (torch.profiler), for one of the harness's shapes.

    python benchmarks/profile_step.py [--shape mid] [--steps 4]

Runs the same model, batch and fused AdamW as benchmarks/harness.py, profiles `--steps` steps
after two warm-up steps, and prints the ops by self CPU time, each op's share, and the achieved
GFLOP/s of the matmuls (the profiler's FLOP count) against the measured matmul peak: the part of
the gap to 100% MFU that is matmuls running below peak, and the part that is time outside matmuls.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import SHAPES, THREADS, matmul_peak, shape_config  # noqa: E402

from llmtrain.config.derived import seq_len_of
from llmtrain.data import prepare_data  # noqa: E402
from llmtrain.model import GPT  # noqa: E402
from llmtrain.model_tensors import model_tensors  # noqa: E402

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="mid", choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rows", type=int, default=18)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    cfg = shape_config(args.shape, Path("unused"))
    data = prepare_data(cfg.data, log=lambda _: None)
    tokens = data.tokens("train")
    seq_len, micro = seq_len_of(cfg), cfg.micro_batch_size
    vocab = cfg.model.vocab_size or data.vocab_size
    torch.manual_seed(0)
    model = GPT(cfg.model, vocab)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, fused=True)
    rng = np.random.default_rng(0)
    offsets = np.arange(seq_len + 1)

    def step() -> None:
        starts = rng.integers(0, tokens.size - seq_len, size=micro)
        window = torch.from_numpy(tokens[starts[:, None] + offsets].astype(np.int64))
        x, y = window[:, :-1], window[:, 1:]
        F.cross_entropy(model(x).view(-1, vocab), y.reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        for _ in range(args.steps):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    matmul_time = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    matmul_flops = sum(e.flops for e in events if e.key in MATMUL_OPS)
    peak = matmul_peak()
    model_flops = model_tensors(model.cfg, model.vocab_size).flops_per_token(seq_len) * micro * seq_len * args.steps
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(f"shape {args.shape}: {args.steps} steps, {total / 1e6 / args.steps * 1e3:,.1f} ms/step (profiled)")
    print(f"matmuls: {matmul_time / total:.0%} of the time, {matmul_flops / (matmul_time / 1e6) / 1e9:,.0f} GFLOP/s "
          f"(peak {peak / 1e9:,.0f}: {matmul_flops / (matmul_time / 1e6) / peak:.0%} of it)")
    print(f"everything else: {1 - matmul_time / total:.0%} of the time")
    print(f"MFU (model FLOPs / profiled time / peak): {model_flops / (total / 1e6) / peak:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
