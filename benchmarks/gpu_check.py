"""The GPU check of issue 7: `gpt_small` with bf16 on one CUDA device for about two minutes,
reporting tokens/s and MFU. Run it where a GPU is (never a test dependency):

    python benchmarks/gpu_check.py [--seconds 120] [--micro-batch-size 16] [--compile auto]
    python benchmarks/gpu_check.py --smoke        # the same path on CPU with a tiny model (seconds)

It trains through `llmtrain train` itself (the real loop: monitor, checkpoints off, evaluation off)
on the embedded corpus (byte tokens; throughput does not depend on the text), reads tokens/s from
the run's metrics.jsonl (median of the log intervals after the first, which holds compilation and
warm-up), and divides the model FLOPs per second (6N + attention, as the banner counts them) by
two peaks: the device's dense bf16 peak from its datasheet when known, and a bf16 matmul measured
in this run (8192^3, median of 10). Prints one JSON line too, for docs/performance.md.
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

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, FLOP/s.
DATASHEET_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def measured_matmul_peak(device: str, dtype: torch.dtype, size: int, reps: int = 10) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return 2 * size**3 / statistics.median(times)


def datasheet_peak(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in DATASHEET_BF16.items() if key in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="training time to aim for")
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--smoke", action="store_true", help="CPU, gpt_tiny, fp32, a few steps: checks the script")
    args = parser.parse_args()

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; use --smoke to check the script on CPU")
    model, precision = ("gpt_tiny", "fp32") if args.smoke else ("gpt_small", "bf16")
    out = Path(tempfile.mkdtemp(prefix="llmtrain-gpu-check-"))
    # A first short run measures the step time; the real run's step count then fills --seconds.
    steps = 20 if args.smoke else 60
    base = ["model=" + model, "precision=" + precision, f"device={device}", f"compile={args.compile}",
            f"micro_batch_size={args.micro_batch_size}", f"global_batch_size={args.micro_batch_size}",
            "eval_interval=0", "checkpoint.every_steps=null", "checkpoint.every_minutes=null", "checkpoint.final=false",
            "schedule.warmup_steps=2", "allow_check_failures=true"]
    run(base + [f"max_steps={steps}", "log_interval=5", f"hydra.run.dir={out / 'probe'}"])
    # From the probe's own log intervals after the first: its wall time holds the process's start and
    # the compilation, which made the first GPU run 70 steps (4.5 s) long instead of --seconds.
    probe = [r for r in map(json.loads, (out / "probe" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    per_step = (probe[-1]["elapsed_s"] - probe[1]["elapsed_s"]) / (probe[-1]["step"] - probe[1]["step"])
    steps = max(40, int(args.seconds / per_step)) if not args.smoke else 40
    log_interval = max(10, steps // 20)
    run(base + [f"max_steps={steps}", f"log_interval={log_interval}", f"hydra.run.dir={out / 'run'}"])

    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"][1:]  # the first interval holds compile + warm-up
    start = next(r for r in records if r["kind"] == "start")
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in train)
    flops_per_s = statistics.median(r["flops_per_s"] for r in train)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    measured = measured_matmul_peak(device, dtype, 1024 if args.smoke else 8192)
    sheet = datasheet_peak(device)
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "model": model, "precision": precision, "compile": args.compile, "micro_batch_size": args.micro_batch_size,
        "tokens_per_step": start["tokens_per_step"], "steps": steps, "seconds": round(train[-1]["elapsed_s"], 1),
        "tokens_per_s": round(tokens_per_s), "model_tflops_per_s": round(flops_per_s / 1e12, 2),
        "matmul_peak_tflops_measured": round(measured / 1e12, 1),
        "mfu_vs_measured_matmul": round(flops_per_s / measured, 3),
        "mfu_vs_datasheet": round(flops_per_s / sheet, 3) if sheet else None,
        "torch": torch.__version__,
    }
    for key, value in result.items():
        print(f"{key:>28}  {value}")
    print(json.dumps(result))


def run(overrides: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "llmtrain", "train", *overrides], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"gpu_check: llmtrain train failed (exit {proc.returncode}):\n"
                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


if __name__ == "__main__":
    main()
