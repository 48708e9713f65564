"""Sampling speed: `llmtrain sample`'s generation against a bare cached-generation loop, and the
wall time of the command itself.

    python benchmarks/bench_sample.py [--run RUN_DIR] [--tokens 1000] [--reps 5] [--wall-reps 3] [--json out.json]

Generation (in this process): llmtrain's path is `generate` (llmtrain/generation.py: one prefill of
the prompt, then one token per `GPT.forward(idx, cache)`, the model's one forward, through the KV
cache; past the window, a refill from the last half window). The bare loop is written here in plain
PyTorch against the same weights: a key/value buffer per layer, one token per step, the same refill,
no module calls:

    x = wte[tok] + wpe[pos]; per layer: layer_norm, qkv linear, write k/v, SDPA over the cache, ...

Both produce the same tokens from the same prompt (checked), greedy and sampled at temperature 1
with the same seed (`llmtrain sample`'s default), on the threads `llmtrain sample` generates with
(one for a model this small; --threads to change), alternating (bare, llmtrain, llmtrain, bare,
...) after one untimed warm-up each, so drift in the machine's speed hits both alike. Reported
(medians): tokens/s of each and the ratio llmtrain / bare (target >= 0.9).

Wall time (fresh processes): `llmtrain sample RUN --max-new-tokens N --ignore-end-of-text` (all N
tokens even when the model ends its text early; target for N = 1000: < 6 s), beside
`--max-new-tokens 1` (start-up and loading) and `python -c "import torch"`, which split it.

Without --run, a default-shaped run dir (gpt_tiny, byte tokens, context 256, seeded random weights:
the speed of a trained one) is written to a temporary folder; give --run /path/to/a/default/run to
time a trained one.
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
import torch.nn.functional as F
import yaml

from llmtrain.config.schema import Config, MlpKind, NormKind, NormPosition, PositionEncoding, config_to_dict
from llmtrain.data.tokenizers import ByteTokenizer, save_tokenizer
from llmtrain.generation import generate, generation_threads
from llmtrain.model import GPT, norm_eps, param_count
from llmtrain.runs.artifacts import TrainedRun, load_run

PROMPT = "\n"  # `llmtrain sample`'s default prompt


def default_run(folder: Path) -> Path:
    """A run dir as `llmtrain train` with every default leaves it (config.yaml, tokenizer.json,
    model.pt), its weights seeded random: sampling runs at the speed of a trained model's."""
    cfg = Config()
    tokenizer = ByteTokenizer()
    (folder / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    save_tokenizer(tokenizer, folder / "tokenizer.json")
    torch.manual_seed(0)
    torch.save(GPT(cfg.model, tokenizer.vocab_size).state_dict(), folder / "model.pt")
    return folder


def check_bare_supports(model: GPT) -> None:
    cfg = model.cfg
    recipe = (cfg.position is PositionEncoding.learned and cfg.norm is NormKind.layernorm and cfg.mlp is MlpKind.gelu
              and cfg.norm_position is NormPosition.pre and (cfg.n_kv_head or cfg.n_head) == cfg.n_head and cfg.bias)
    if not recipe:
        sys.exit("bench_sample: the bare loop is written for the default recipe (learned positions, pre-LN "
                 "layernorm with biases, GELU MLP, plain multi-head attention); this run's model differs")


@torch.no_grad()  # as llmtrain generates
def bare_generate(model: GPT, prompt: list[int], n: int, window: int, vocab_limit: int, temperature: float,
                  generator: torch.Generator | None) -> list[int]:
    """The bare cached loop: the model's tensors, plain torch functions, one buffer per layer."""
    cfg = model.cfg
    H, D, eps = cfg.n_head, cfg.n_embd // cfg.n_head, norm_eps(cfg)
    wte, wpe = model.wte.weight, model.wpe.weight
    layers = [(b.norm1.weight, b.norm1.bias, b.attn.qkv.weight, b.attn.qkv.bias, b.attn.proj.weight, b.attn.proj.bias,
               b.norm2.weight, b.norm2.bias, b.mlp.up.weight, b.mlp.up.bias, b.mlp.down.weight, b.mlp.down.bias)
              for b in model.blocks]
    lnf_w, lnf_b, head = model.norm_f.weight, model.norm_f.bias, model.lm_head.weight
    keys = [torch.empty(1, H, window, D) for _ in layers]
    values = [torch.empty(1, H, window, D) for _ in layers]
    keep = max(1, window // 2)

    def forward(ids: list[int], start: int) -> torch.Tensor:
        T = len(ids)
        x = wte[torch.tensor(ids)] + wpe[start:start + T]
        x = x.unsqueeze(0)
        for i, (n1w, n1b, qw, qb, pw, pb, n2w, n2b, uw, ub, dw, db) in enumerate(layers):
            h = F.layer_norm(x, (cfg.n_embd,), n1w, n1b, eps)
            q, k, v = F.linear(h, qw, qb).view(1, T, 3, H, D).permute(2, 0, 3, 1, 4)
            keys[i][:, :, start:start + T] = k
            values[i][:, :, start:start + T] = v
            y = F.scaled_dot_product_attention(q, keys[i][:, :, :start + T], values[i][:, :, :start + T],
                                               is_causal=start == 0)
            x = x + F.linear(y.transpose(1, 2).reshape(1, T, cfg.n_embd), pw, pb)
            h = F.layer_norm(x, (cfg.n_embd,), n2w, n2b, eps)
            x = x + F.linear(F.gelu(F.linear(h, uw, ub), approximate="tanh"), dw, db)
        return F.linear(F.layer_norm(x[:, -1], (cfg.n_embd,), lnf_w, lnf_b, eps), head)

    held = prompt[-window:]
    logits = forward(held, 0)
    out: list[int] = []
    while True:
        logits[:, vocab_limit:] = float("-inf")
        if temperature <= 0:
            token = int(logits.argmax(dim=-1))
        else:
            token = int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator))
        out.append(token)
        if len(out) == n:
            return out
        if len(held) == window:  # full: refill from the last half window, as generate does
            held = held[len(held) - keep + 1:] + [token] if keep > 1 else [token]
            logits = forward(held, 0)
        else:
            held.append(token)
            logits = forward([token], len(held) - 1)


def llmtrain_generate(run: TrainedRun, prompt: list[int], n: int, temperature: float,
                      generator: torch.Generator | None) -> list[int]:
    return generate(run.model, prompt, n, temperature, None, generator, context=run.context,
                    vocab_limit=run.tokenizer.vocab_size)


def bench_generation(run: TrainedRun, n: int, reps: int, temperature: float, console) -> dict:
    prompt = run.tokenizer.encode(PROMPT)
    window = min(run.context, run.model.cfg.block_size)
    paths = {
        "bare": lambda g: bare_generate(run.model, prompt, n, window, run.tokenizer.vocab_size, temperature, g),
        "llmtrain": lambda g: llmtrain_generate(run, prompt, n, temperature, g),
    }
    seconds: dict[str, list[float]] = {path: [] for path in paths}
    tokens: dict[str, list[int]] = {}
    for rep in range(reps + 1):  # the first pass is the untimed warm-up
        order = list(paths.items()) if rep % 2 else list(paths.items())[::-1]  # who goes first alternates too
        for path, fn in order:
            generator = torch.Generator().manual_seed(0)
            start = time.perf_counter()
            tokens[path] = fn(generator)
            if rep:
                seconds[path].append(time.perf_counter() - start)
        if rep:
            console.print(f"temperature {temperature:g} rep {rep}/{reps}: "
                          f"bare {n / seconds['bare'][-1]:,.0f} tokens/s, "
                          f"llmtrain {n / seconds['llmtrain'][-1]:,.0f} tokens/s")
    med = {path: statistics.median(s) for path, s in seconds.items()}
    return {"temperature": temperature, "tokens": n, "seconds": seconds,
            "tokens_per_s": {path: n / m for path, m in med.items()}, "ratio": med["bare"] / med["llmtrain"],
            "same_tokens": tokens["bare"] == tokens["llmtrain"]}


def wall(command: list[str], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a default-shaped run dir (default: a fresh seeded one in a temp dir)")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens generated per pass (default 1000)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--wall-reps", type=int, default=3, help="runs of the command per wall figure; 0 skips them")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of both loops (default: those `llmtrain sample` uses)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    from rich.console import Console

    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run or default_run(Path(tmp))
        run = load_run(run_dir)
        check_bare_supports(run.model)
        # both loops on the threads `llmtrain sample` generates with, unless told otherwise
        torch.set_num_threads(args.threads or generation_threads(run.model, torch.get_num_threads()))
        results = {"run": str(args.run or "a seeded default-shaped run"), "params": param_count(run.model),
                   "context": run.context, "threads": torch.get_num_threads(),
                   "generation": [bench_generation(run, args.tokens, args.reps, t, console) for t in (0.0, 1.0)]}
        if args.wall_reps:
            sample = [sys.executable, "-m", "llmtrain", "sample", str(run_dir), "--ignore-end-of-text"]
            results["wall_s"] = {
                "sample": wall([*sample, "--max-new-tokens", str(args.tokens)], args.wall_reps),
                "sample_1_token": wall([*sample, "--max-new-tokens", "1"], args.wall_reps),
                "import_torch": wall([sys.executable, "-c", "import torch"], args.wall_reps),
            }
    console.print(f"model: {results['params'] / 1e6:.2f}M parameters, context {results['context']}, "
                  f"{results['threads']} threads, {args.tokens} tokens per pass, medians of {args.reps}")
    for r in results["generation"]:
        met = "met" if r["ratio"] >= 0.9 else "NOT met (on a busy machine, rerun with more --reps)"
        console.print(f"temperature {r['temperature']:g}: bare {r['tokens_per_s']['bare']:,.0f} tok/s, llmtrain "
                      f"{r['tokens_per_s']['llmtrain']:,.0f} tok/s, ratio [bold]{r['ratio']:.3f}[/] (target >= 0.9 "
                      f"{met}); same tokens: {r['same_tokens']}")
    if "wall_s" in results:
        w = {name: statistics.median(times) for name, times in results["wall_s"].items()}
        verdict = ("met" if w["sample"] < 6 else "NOT met") if args.tokens == 1000 else "for 1000 tokens"
        console.print(f"`llmtrain sample --max-new-tokens {args.tokens}`: "
                      f"[bold]{w['sample']:.2f} s[/] wall (target < 6 s "
                      f"{verdict}); of it start-up and loading (1 token) {w['sample_1_token']:.2f} s, "
                      f"`import torch` alone {w['import_torch']:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    # Speed is read, not enforced (a shared machine's noise); different tokens are a bug.
    return 0 if all(r["same_tokens"] for r in results["generation"]) else 1


if __name__ == "__main__":
    sys.exit(main())
