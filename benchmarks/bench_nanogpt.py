"""llmtrain against nanoGPT on nanoGPT's own CPU recipe, side by side on this machine.

    python benchmarks/bench_nanogpt.py --nanogpt ~/src/nanoGPT [--iters 2000] [--reps 1] [--json out.json]

The recipe is nanoGPT README's "shakespeare_char on a CPU": 4 layers, 4 heads, width 128, context 64,
batch 12, no dropout, lr 1e-3 with 100 warm-up steps decaying to 1e-4 over the run, beta2 0.99,
evaluation every 250 iterations on 20 batches. Both read the same text (`--text`, default ~1.1 MB of
this Python's standard library sources, about the size of tiny-shakespeare: nothing downloads) as
characters, split 90/10. Four programs run, alternating, each in a fresh process:

    nanogpt           train.py --compile=False (its README's command)
    nanogpt compile   train.py --compile=True
    llmtrain          `llmtrain train` with its defaults (monitor, checkpoints, evaluation, report)
                      and the recipe's values, bias off as nanoGPT's; compile=auto
    llmtrain eager    the same with compile=off

ms/iter is each program's own time per training iteration over the run, evaluations included and
the first iteration (and a compile it holds) excluded: nanoGPT's printed per-iteration times summed
from iteration 1, llmtrain's `train` records' elapsed time from its first log step. Wall is the
process from launch to exit. Val loss is each one's last evaluation (nanoGPT's estimate over 20
batches, llmtrain's over 20 fixed batches). nanoGPT runs with torch's default threads (one per
core); llmtrain with threads=auto.

compile=auto decides from this machine's record of the shape (llmtrain's cache): the first run of
the recipe on a machine measures it (a few seconds of its steps, and the compile), later runs
follow the verdict. `--fresh-records` measures again (a temporary LLMTRAIN_CACHE for the run).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RECIPE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 12, "lr": 1e-3,
          "min_lr": 1e-4, "warmup": 100, "beta2": 0.99, "eval_interval": 250, "eval_iters": 20}
TEXT_CHARS = 1_115_394  # tiny-shakespeare's length


def default_text(path: Path) -> Path:
    """~1.1 MB of ASCII from the standard library's sources (sorted files: the same text every time)."""
    parts, size = [], 0
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = "".join(c for c in source.read_text(encoding="utf-8", errors="ignore") if ord(c) < 128)
        parts.append(text)
        size += len(text)
        if size > TEXT_CHARS:
            break
    path.write_text("".join(parts)[:TEXT_CHARS])
    return path


def nanogpt_data(text: Path, folder: Path) -> None:
    """nanoGPT's shakespeare_char/prepare.py, on our text: characters -> uint16 ids, 90/10."""
    data = text.read_text()
    chars = sorted(set(data))
    stoi = {c: i for i, c in enumerate(chars)}
    cut = int(len(data) * 0.9)
    folder.mkdir(parents=True, exist_ok=True)
    np.array([stoi[c] for c in data[:cut]], dtype=np.uint16).tofile(folder / "train.bin")
    np.array([stoi[c] for c in data[cut:]], dtype=np.uint16).tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)


# The whole validation text, scored the same way for both (non-overlapping windows of the context,
# mean cross-entropy per character), by each program's own model and encoding: the val losses the
# programs print are estimates over 20 batches (nanoGPT's drawn at random), ~0.02 apart by chance.
NANOGPT_SCORE = """
import sys, numpy as np, torch, torch.nn.functional as F
from model import GPT, GPTConfig
ckpt = torch.load(sys.argv[1], map_location="cpu")
model = GPT(GPTConfig(**ckpt["model_args"]))
model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
model.eval()
ids = torch.from_numpy(np.fromfile(sys.argv[2], dtype=np.uint16).astype(np.int64))
T = int(sys.argv[3]); n = (len(ids) - 1) // T
x, y = ids[: n * T].view(n, T), ids[1 : n * T + 1].view(n, T)
with torch.no_grad():
    total = sum(F.cross_entropy(model(x[i:i + 64], y[i:i + 64])[0].view(-1, model.config.vocab_size),
                                y[i:i + 64].reshape(-1), reduction="sum").item() for i in range(0, n, 64))
print(total / (n * T))
"""


def llmtrain_score(run_dir: Path, text: Path) -> float:
    """llmtrain's final weights on the last 10% of the text (its val split of one file), as above."""
    import torch
    import torch.nn.functional as F

    from llmtrain.runs.artifacts import load_run

    run = load_run(run_dir)
    data = text.read_text()
    ids = torch.tensor(run.tokenizer.encode(data[int(len(data) * 0.9):]), dtype=torch.long)
    window = RECIPE["block_size"]
    n = (len(ids) - 1) // window
    x, y = ids[: n * window].view(n, window), ids[1: n * window + 1].view(n, window)
    with torch.no_grad():
        total = sum(F.cross_entropy(run.model(x[i:i + 64]).flatten(0, 1), y[i:i + 64].reshape(-1),
                                    reduction="sum").item() for i in range(0, n, 64))
    return total / (n * window)


def run_nanogpt(checkout: Path, iters: int, compile_: bool, out: Path) -> dict:
    r = RECIPE
    command = [sys.executable, "train.py", "config/train_shakespeare_char.py", "--dataset=bench_char", "--device=cpu",
               f"--compile={compile_}", f"--eval_iters={r['eval_iters']}", "--log_interval=1",
               f"--block_size={r['block_size']}", f"--batch_size={r['batch_size']}", f"--n_layer={r['n_layer']}",
               f"--n_head={r['n_head']}", f"--n_embd={r['n_embd']}", f"--max_iters={iters}",
               f"--lr_decay_iters={iters}", "--dropout=0.0", f"--out_dir={out}"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=checkout, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"nanoGPT failed:\n{done.stderr[-3000:]}")
    times = [float(t) for t in re.findall(r"iter \d+: loss [\d.]+, time ([\d.]+)ms", done.stdout)]
    vals = re.findall(r"val loss ([\d.]+)", done.stdout)
    score = subprocess.run([sys.executable, "-c", NANOGPT_SCORE, str(out / "ckpt.pt"),
                            str(checkout / "data" / "bench_char" / "val.bin"), str(RECIPE["block_size"])],
                           cwd=checkout, capture_output=True, text=True, check=True)
    return {"ms_per_iter": sum(times[1:]) / (len(times) - 1), "median_ms": statistics.median(times[1:]),
            "wall_s": wall, "val_loss": float(vals[-1]), "held_out": float(score.stdout.strip().splitlines()[-1])}


def run_llmtrain(text: Path, iters: int, compile_: str, out: Path, env: dict) -> dict:
    r = RECIPE
    command = [sys.executable, "-m", "llmtrain", "train", "data=text", f"data.path={text}", "data.tokenizer=char",
               "data.val_fraction=0.1", f"model.n_layer={r['n_layer']}", f"model.n_head={r['n_head']}",
               f"model.n_embd={r['n_embd']}", f"model.block_size={r['block_size']}", "model.bias=false",
               f"global_batch_size={r['batch_size']}", f"max_steps={iters}", f"optim.lr={r['lr']}",
               f"optim.beta2={r['beta2']}", f"schedule.warmup_steps={r['warmup']}",
               f"schedule.min_lr_ratio={r['min_lr'] / r['lr']}", f"eval_interval={r['eval_interval']}",
               f"eval_batches={r['eval_iters']}", f"compile={compile_}", f"out_dir={out}"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"llmtrain failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [(rec["step"], rec["elapsed_s"]) for rec in records if rec["kind"] == "train"]
    (first_step, first_s), (last_step, last_s) = train[0], train[-1]
    intervals = [(b[1] - a[1]) / (b[0] - a[0]) * 1e3 for a, b in zip(train, train[1:])]
    vals = [rec["val_loss"] for rec in records if rec["kind"] == "eval"]
    compiled = [rec for rec in records if rec["kind"] == "compile"]
    return {"ms_per_iter": (last_s - first_s) / (last_step - first_step) * 1e3,
            "median_ms": statistics.median(intervals), "wall_s": wall, "val_loss": vals[-1],
            "held_out": llmtrain_score(out, text),
            "compile_trial": compiled[0] if compiled else None,
            "banner_compile": next((line.strip() for line in done.stdout.splitlines() if "compile" in line), None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout (karpathy/nanoGPT)")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--text", type=Path, default=None)
    parser.add_argument("--programs", default="nanogpt,nanogpt_compile,llmtrain,llmtrain_eager")
    parser.add_argument("--fresh-records", action="store_true", help="compile=auto measures again (temp cache)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_nanogpt_"))
    try:
        checkout = work / "nanoGPT"
        shutil.copytree(args.nanogpt, checkout, ignore=shutil.ignore_patterns(".git", "out*"))
        text = args.text or default_text(work / "input.txt")
        nanogpt_data(text, checkout / "data" / "bench_char")
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if args.fresh_records:
            env["LLMTRAIN_CACHE"] = str(work / "cache")
        programs = args.programs.split(",")
        results: dict[str, list[dict]] = {name: [] for name in programs}
        for rep in range(args.reps):
            for name in programs:
                out = work / f"{name}-{rep}"
                if name.startswith("nanogpt"):
                    result = run_nanogpt(checkout, args.iters, name.endswith("compile"), out)
                else:
                    result = run_llmtrain(text, args.iters, "off" if name.endswith("eager") else "auto", out, env)
                results[name].append(result)
                print(f"rep {rep} {name:16s} {result['ms_per_iter']:7.2f} ms/iter "
                      f"(median {result['median_ms']:.2f}) wall {result['wall_s']:6.1f} s  "
                      f"val {result['val_loss']:.4f}  held-out {result['held_out']:.4f}",
                      flush=True)
        keys = ("ms_per_iter", "median_ms", "wall_s", "val_loss", "held_out")
        summary = {name: {key: statistics.median(r[key] for r in runs) for key in keys}
                   for name, runs in results.items()}
        print("\nmedians over the reps; speed = nanoGPT eager's ms/iter / the program's")
        base = summary.get("nanogpt", {}).get("ms_per_iter")
        for name, s in summary.items():
            speed = f"{base / s['ms_per_iter']:.3f}x" if base else "-"
            print(f"  {name:16s} {s['ms_per_iter']:7.2f} ms/iter  {speed:>7s}  wall {s['wall_s']:6.1f} s  "
                  f"val {s['val_loss']:.4f}  held-out {s['held_out']:.4f}")
        if "llmtrain" in summary and "nanogpt_compile" in summary:
            print(f"  llmtrain / nanoGPT --compile=True: "
                  f"{summary['nanogpt_compile']['ms_per_iter'] / summary['llmtrain']['ms_per_iter']:.3f}x")
        if args.json:
            args.json.write_text(json.dumps({"summary": summary, "runs": results}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
