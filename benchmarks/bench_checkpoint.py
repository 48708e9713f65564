"""Checkpoint save/load throughput for gpt_small + AdamW against plain sequential I/O of the same bytes.

    python benchmarks/bench_checkpoint.py [--reps 3] [--dir /path/on/the/disk/to/test]

A save is llmtrain's whole `save_checkpoint` (checkpoint/write.py), from reading the model's and
optimizer's state dicts on: torch.save of model, optimizer and RNG states with a sha256 computed
on the way out, fsync of every file, the manifest, the atomic rename and the `latest` pointer. The
reference writes the same number of bytes from memory in 8 MiB chunks to one file with one fsync:
the disk's own sequential speed, measured in the same run. Loading is `load_checkpoint` (sha256 of
every file checked before it is read, `weights_only=True`) against a plain sequential read of the
same bytes; both read from the page cache, so it measures CPU cost.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from llmtrain.checkpoint.read import load_checkpoint
from llmtrain.checkpoint.write import CheckpointContents, save_checkpoint
from llmtrain.config.schema import ModelConfig
from llmtrain.engine.state import TrainState
from llmtrain.model import GPT, param_count

CHUNK = 8 << 20


def gpt_small_with_adamw() -> tuple[GPT, torch.optim.Optimizer]:
    cfg = ModelConfig(name="gpt_small", n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)
    model = GPT(cfg, 50304)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    for p in model.parameters():  # one step with random gradients: both Adam moments exist
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def plain_write(path: Path, size: int) -> float:
    buffer = memoryview(os.urandom(CHUNK))
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left > 0:
            left -= os.write(fd, buffer[: min(CHUNK, left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def plain_read(path: Path) -> float:
    start = time.perf_counter()
    with open(path, "rb") as fh:
        while fh.read(CHUNK):
            pass
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    console = Console()
    model, optimizer = gpt_small_with_adamw()
    console.print(f"gpt_small: {param_count(model):,} parameters, AdamW state for each")
    results: dict[str, list[float]] = {"save": [], "write": [], "load": [], "read": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        size = 0
        for rep in range(args.reps):
            run = root / f"run{rep}"
            start = time.perf_counter()
            contents = CheckpointContents(state=TrainState(step=rep + 1), config={}, sampler={},
                                          model=model.state_dict(), optimizer=optimizer.state_dict())
            path = save_checkpoint(run, contents)
            results["save"].append(time.perf_counter() - start)
            size = sum(f.stat().st_size for f in path.iterdir())
            results["write"].append(plain_write(root / f"plain{rep}.bin", size))
            start = time.perf_counter()
            load_checkpoint(path)
            results["load"].append(time.perf_counter() - start)
            results["read"].append(plain_read(root / f"plain{rep}.bin"))
            console.print(f"rep {rep + 1}: save {results['save'][-1]:.2f}s, plain write {results['write'][-1]:.2f}s, "
                          f"load {results['load'][-1]:.2f}s, plain read {results['read'][-1]:.2f}s")
            shutil.rmtree(run)
    med = {k: statistics.median(v) for k, v in results.items()}
    gb = size / 1e9
    table = Table(title=f"checkpoint of gpt_small + AdamW: {gb:.2f} GB in 5 files")
    for col in ("operation", "median s", "GB/s", "vs plain I/O"):
        table.add_column(col)
    table.add_row("llmtrain save", f"{med['save']:.2f}", f"{gb / med['save']:.2f}", f"{med['write'] / med['save']:.0%}")
    table.add_row("plain write + fsync", f"{med['write']:.2f}", f"{gb / med['write']:.2f}", "100%")
    table.add_row("llmtrain load (verified)", f"{med['load']:.2f}", f"{gb / med['load']:.2f}",
                  f"{med['read'] / med['load']:.0%}")
    table.add_row("plain read", f"{med['read']:.2f}", f"{gb / med['read']:.2f}", "100%")
    console.print(table)
    console.print(f"save throughput = {med['write'] / med['save']:.0%} of a plain sequential write (target >= 50%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
