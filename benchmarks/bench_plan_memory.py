"""`llmtrain plan`'s per-device memory against the peak a real run reaches, for the shipped shapes
(gpt2, gpt2_medium, smollm_135m) in the layouts this machine can run: one process, 2 gloo
processes under fsdp, tp and pp, and 3 under tp (tp3, for smollm_135m's 9 heads).

    python benchmarks/bench_plan_memory.py                                  # every model x layout
    python benchmarks/bench_plan_memory.py --models gpt2 --layouts single,fsdp --seq 512 --json out.json
    python benchmarks/bench_plan_memory.py --models gpt2 --layouts fsdp,tp,pp --seq 128 --override model.n_layer=2

Each case is a 2-step run (the second step holds the optimizer's state, so it reaches the peak) of
the model at its own shape with a vocabulary of 50,304 (GPT-2's, padded) unless the model sets its
own, fp32 on CPU, a micro-batch of --micro sequences of --seq tokens (default: the model's context),
the monitor on as a user runs it, no evaluation and no checkpoints (whose gathers are not the
training peak). Every process reports its own peak resident memory (VmHWM); the figure compared is
the highest over the ranks, as the plan's per-device figure is the heaviest device's. The prediction
is the plan's (llmtrain.plan.build.plan_config) for that layout on that many devices, computed in
the same process before training (so it sees the same host facts the check sees).
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

MODELS = ("gpt2", "gpt2_medium", "smollm_135m")
# layout name -> (processes, the overrides that select it, the plan degrees it corresponds to)
LAYOUTS: dict[str, tuple[int, list[str], dict[str, int]]] = {
    "single": (1, [], {}),
    "fsdp": (2, ["parallel=fsdp", "parallel.nproc=2"], {"dp_shard": 2}),
    "tp": (2, ["parallel=tp", "parallel.nproc=2"], {"tp": 2}),
    "pp": (2, ["parallel=pp", "parallel.nproc=2"], {"pp": 2}),
    # smollm_135m's 9 heads and 3 key/value heads split 3 ways, not 2
    "tp3": (3, ["parallel=tp", "parallel.nproc=3", "parallel.tp=3"], {"tp": 3}),
}
GPT2_VOCAB = 50304

# Run in a fresh interpreter (one per rank under torchrun): compose the config, take the plan's
# prediction for the layout, train, then report this process's peak.
_RANK_SCRIPT = """
import json, os, sys
import torch
from llmtrain.cli.compose import compose_config
from llmtrain.plan.build import plan_config
from llmtrain.training.loop import train

args = json.loads(sys.argv[1])
cfg = compose_config(args["overrides"])
torch.set_num_threads(args["threads"])
plan = plan_config(cfg, devices=args["devices"])
wanted = args["degrees"]
match = [c for c in plan.costs
         if all(getattr(c.layout.degrees, k) == wanted.get(k, 1) for k in ("dp_replicate", "dp_shard", "tp", "pp"))]
predicted = match[0].plain.peak if match else None
train(cfg)
"""


def run_case(model: str, layout: str, seq: int | None, micro: int, workdir: Path, extra: list[str]) -> dict:
    nproc, layout_overrides, degrees = LAYOUTS[layout]
    out = workdir / f"{model}_{layout}"
    out.mkdir(parents=True, exist_ok=True)
    data_parallel = degrees.get("dp_shard", 1) * degrees.get("dp_replicate", 1)
    if "pp" in degrees:  # a pipeline needs as many micro-batches in its window as it has stages
        layout_overrides = [*layout_overrides, f"parallel.pp_microbatches={degrees['pp']}"]
        data_parallel = degrees["pp"]
    overrides = [f"model={model}", "max_steps=2", "schedule.warmup_steps=1", f"micro_batch_size={micro}",
                 f"global_batch_size={micro * data_parallel}", "eval_interval=0", "checkpoint=none",
                 "report.enabled=false", "device=cpu", "precision=fp32", f"out_dir={out / 'run'}",
                 *layout_overrides]
    if model != "smollm_135m":  # smollm sets its own vocabulary
        overrides.append(f"model.vocab_size={GPT2_VOCAB}")
    if seq is not None:
        overrides.append(f"model.block_size={seq}")
    overrides += extra
    threads = max(1, (os.cpu_count() or 2) // nproc)
    payload = {"overrides": overrides, "devices": nproc, "degrees": degrees, "threads": threads, "out": str(out)}
    ranks = run_ranks(_RANK_SCRIPT, payload, nproc, out)
    if isinstance(ranks, str):
        return {"model": model, "layout": layout, "error": [ranks]}
    measured = max(r["measured"] for r in ranks)
    predicted = ranks[0]["predicted"]
    return {"model": model, "layout": layout, "processes": nproc, "seq": seq, "micro": micro,
            "predicted": predicted, "measured": measured, "per_rank": [r["measured"] for r in ranks],
            "ratio": predicted / measured if predicted else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's context)")
    parser.add_argument("--micro", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a further override of every case (repeatable), e.g. model.n_layer=2")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_plan_memory_") as tmp:
        for model in args.models.split(","):
            for layout in args.layouts.split(","):
                result = run_case(model, layout, args.seq, args.micro, Path(tmp), args.override)
                results.append(result)
                if "error" in result:
                    print(f"{model:12} {layout:7} FAILED: {' | '.join(result['error'])}", flush=True)
                    continue
                print(f"{model:12} {layout:7} plan {result['predicted'] / 2**30:6.2f} GiB  measured "
                      f"{result['measured'] / 2**30:6.2f} GiB  (ratio {result['ratio']:.2f}; ranks "
                      f"{', '.join(f'{m / 2**30:.2f}' for m in result['per_rank'])})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
