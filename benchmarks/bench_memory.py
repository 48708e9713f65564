"""The memory savers' predicted peak (llmtrain/preflight/savers.py, what `llmtrain check`'s memory row
and `llmtrain plan` print) against the peak a real run reaches, one case per saver, on CPU.

    python benchmarks/bench_memory.py                         # every saver
    python benchmarks/bench_memory.py --cases none,op --json out.json

The config: 6 blocks x 256 wide, context 256, micro-batch 16 (global batch 16), a vocabulary of
50,304 (GPT-2's, padded: the head and the loss matter as much as the blocks), AdamW, fp32 on CPU,
the default data (python_stdlib, byte tokens, prepared beforehand as the estimate assumes). Each
case is that config with one saver's overrides, a 2-step run (the second step holds the optimizer's
state, so it reaches the peak) in a fresh process, no evaluation, no checkpoints, no report. The
two-process cases (zero1, fsdp over 2) run under `torch.distributed.run`, each rank reporting its
own peak; the figure compared is the highest, as the prediction is one rank's.

Prediction: `savers.predicted_peak(config, basis, overrides)`, the one estimate of the config with
the saver's overrides applied, computed in the same process before training (so it sees the same
process memory the check sees), with the basis from the check's facts of the config as given.
Measured: the process's peak resident memory (VmHWM), as tests/conftest.py's
`predicted_and_measured_peak` reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peaks import run_ranks  # noqa: E402 - benchmarks/ is not a package

BASE = ["model.n_layer=6", "model.n_embd=256", "model.n_head=4", "model.block_size=256", "model.vocab_size=50304",
        "micro_batch_size=16", "global_batch_size=16", "max_steps=2", "schedule.warmup_steps=1", "eval_interval=0",
        "checkpoint=none", "report.enabled=false", "device=cpu", "precision=fp32", "log_interval=1"]
# case -> (processes, the saver's overrides as memory_savers would give them)
CASES: dict[str, tuple[int, dict[str, str]]] = {
    "none": (1, {}),
    "micro 4 + accumulation 4": (1, {"micro_batch_size": "4"}),
    "full": (1, {"model.activation_checkpointing": "full"}),
    "op": (1, {"model.activation_checkpointing": "op"}),
    "full every 2": (1, {"model.activation_checkpointing": "full", "model.checkpoint_every": "2"}),
    "op every 2": (1, {"model.activation_checkpointing": "op", "model.checkpoint_every": "2"}),
    "adamw8bit": (1, {"optim": "adamw8bit"}),
    "adafactor": (1, {"optim": "adafactor"}),
    "zero1 over 2": (2, {"parallel": "zero1", "parallel.nproc": "2", "micro_batch_size": "8"}),
    "fsdp over 2": (2, {"parallel": "fsdp", "parallel.nproc": "2", "micro_batch_size": "8"}),
}

# One fresh interpreter per process (one per rank under torchrun): the config as given and its
# check facts (outside torchrun's environment: the memory row judges one process), the saver's
# prediction, then the config with the saver's overrides trained, and this process's peak.
_RANK_SCRIPT = """
import json, os, sys
import torch
from llmtrain.cli.compose import compose_config
from llmtrain.preflight.facts import gather_facts
from llmtrain.preflight.savers import EstimateBasis, predicted_peak
from llmtrain.training.loop import train

args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
saver = args["saver"]
launched = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ}
base = compose_config(args["base"])
basis = EstimateBasis.of_facts(gather_facts(base, measure_compute=False))
predicted = predicted_peak(base, basis, saver)
os.environ.update(launched)
overrides = [f"{k}={v}" for k, v in saver.items()]
if launched:  # torchrun starts the processes: parallel.nproc stays 1
    overrides = [o for o in overrides if not o.startswith("parallel.nproc=")]
cfg = compose_config([*args["base"], *overrides])
train(cfg)
"""


def run_case(name: str, workdir: Path) -> dict:
    nproc, saver = CASES[name]
    out = workdir / name.replace(" ", "_")
    out.mkdir(parents=True, exist_ok=True)
    base = [*BASE, f"out_dir={out / 'run'}"]
    threads = max(1, (os.cpu_count() or 2) // nproc)
    payload = {"base": base, "saver": saver, "threads": threads, "out": str(out)}
    ranks = run_ranks(_RANK_SCRIPT, payload, nproc, out)
    if isinstance(ranks, str):
        return {"case": name, "error": [ranks]}
    measured = max(r["measured"] for r in ranks)
    predicted = ranks[0]["predicted"]
    return {"case": name, "overrides": saver, "processes": nproc, "predicted": predicted, "measured": measured,
            "per_rank": [r["measured"] for r in ranks], "ratio": predicted / measured}


def prepare(workdir: Path) -> None:
    """The data prepared once, before any case: the estimate assumes it is (a run that prepares its
    own data peaks while tokenizing)."""
    from llmtrain.cli.compose import compose_config
    from llmtrain.data import prepare_data

    prepare_data(compose_config([*BASE, f"out_dir={workdir / 'prepare'}"]).data, log=lambda message: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names (see CASES)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        prepare(Path(tmp))
        for name in args.cases.split(","):
            result = run_case(name, Path(tmp))
            results.append(result)
            if "error" in result:
                print(f"{name:26} FAILED: {' | '.join(result['error'])}", flush=True)
                continue
            ranks = f"; ranks {', '.join(f'{m / 2**20:,.0f}' for m in result['per_rank'])}" \
                if result["processes"] > 1 else ""
            print(f"{name:26} predicted {result['predicted'] / 2**20:7,.0f} MiB  measured "
                  f"{result['measured'] / 2**20:7,.0f} MiB  ratio {result['ratio']:.2f}{ranks}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
