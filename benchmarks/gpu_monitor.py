"""The health monitor on a GPU: its cost, and whether it changes the run. Run it where a GPU is:

    python benchmarks/gpu_monitor.py [--steps 200] [--model gpt_small] [--out DIR]
    python benchmarks/gpu_monitor.py --smoke      # the same path on CPU with gpt_tiny (a minute)

On a GPU the monitor's cost is its host syncs (one per check), which stall the queue of kernels the
CPU has launched ahead; on a CPU there is no queue, so the CPU benchmark (bench_monitor.py) cannot
show it. Five `llmtrain train` runs of the same seed, alternating: the monitor off, on, on with
`monitor.repair=true`, off again, on again. Reported: ms/step of each over the steps after the
first 20 (warm-up, allocator, cuDNN/cuBLAS heuristics), the monitor's overhead (the median of the
two on/off pairs; target <= 3%), whether every logged loss and the final weights (`model.pt`) are
bit-identical to the first run's (the monitor reads, never writes; a healthy run raises no alarm, so
repair changes nothing; `--deterministic` for the same kernels in every run), and the report's MFU
line. Prints one JSON line and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

RUNS = (("off", ("monitor.enabled=false",)), ("on", ()), ("repair", ("monitor.repair=true",)),
        ("off2", ("monitor.enabled=false",)), ("on2", ()))
SKIPPED_STEPS = 20


def train(run_dir: Path, overrides: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "llmtrain", "train", *overrides, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"gpu_monitor: llmtrain train failed (exit {proc.returncode}):\n"
                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def ms_per_step(records: list[dict]) -> float:
    """Wall time per step between the first log record after SKIPPED_STEPS and the last one."""
    train = [r for r in records if r["kind"] == "train" and r["step"] >= SKIPPED_STEPS]
    first, last = train[0], train[-1]
    return 1000 * (last["elapsed_s"] - first["elapsed_s"]) / (last["step"] - first["step"])


def same_weights(a: Path, b: Path) -> bool:
    sa, sb = torch.load(a, map_location="cpu"), torch.load(b, map_location="cpu")
    sa, sb = sa.get("model", sa), sb.get("model", sb)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic=true: the same kernels every run (cuDNN/cuBLAS picks otherwise vary)")
    parser.add_argument("--out", type=Path, help="also write the JSON line here")
    parser.add_argument("--smoke", action="store_true", help="CPU, gpt_tiny, fp32, 40 steps: checks the script")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("gpu_monitor: no CUDA device here; use --smoke to check the script on CPU")
    device, model, precision, steps = (("cpu", "gpt_tiny", "fp32", 40) if args.smoke
                                       else ("cuda", args.model, "bf16", args.steps))
    base = [f"model={model}", f"precision={precision}", f"device={device}", "compile=off",
            f"micro_batch_size={args.micro_batch_size}", f"global_batch_size={args.micro_batch_size}",
            f"max_steps={steps}", "log_interval=10", "eval_interval=0", "checkpoint.every_steps=null",
            "checkpoint.every_minutes=null", "checkpoint.final=false", "allow_check_failures=true"]
    if args.smoke:
        base += ["threads=1", "data.seq_len=128"]
    if args.deterministic:
        base.append("deterministic=true")
    root = Path(tempfile.mkdtemp(prefix="llmtrain-gpu-monitor-"))
    records: dict[str, list[dict]] = {}
    for name, extra in RUNS:
        train(root / name, base + list(extra))
        records[name] = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    timing = {name: round(ms_per_step(recs), 2) for name, recs in records.items()}
    overhead = statistics.median([timing["on"] / timing["off"] - 1, timing["on2"] / timing["off2"] - 1])
    losses = {name: [r["loss"] for r in recs if r["kind"] == "train"] for name, recs in records.items()}
    # With the monitor off there is no events.jsonl.
    events = {name: [json.loads(line)["kind"] for path in [root / name / "events.jsonl"] if path.exists()
                     for line in path.read_text().splitlines()] for name in records}
    alarms = {name: sum(kind in ("alarm", "repair") for kind in kinds) for name, kinds in events.items()}
    report = (root / "on" / "report.md").read_text()
    mfu_line = next((line for line in report.splitlines() if "MFU" in line), "")
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "model": model, "precision": precision, "steps": steps,
        "tokens_per_step": records["on"][0]["tokens_per_step"], "ms_per_step": timing,
        "monitor_overhead": round(overhead, 4),
        "deterministic": args.deterministic,
        "losses_identical_to_off": {name: v == losses["off"] for name, v in losses.items()},
        "weights_identical_to_off": {n: same_weights(root / "off" / "model.pt", root / n / "model.pt")
                                     for n in records},
        "alarm_events": alarms, "final_loss": losses["on"][-1], "report_mfu": mfu_line.strip()[:400],
        "peak_flops_per_s": next((r["peak_flops_per_s"] for r in records["on"] if r["kind"] == "health"), None),
        "cuda_peak_mb": next((r.get("cuda_peak_mb") for r in records["on"] if r["kind"] == "end"), None),
    }
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
