"""Loading a 124M Hugging Face checkpoint with model.init_from: time and peak host memory.

    python benchmarks/bench_hf_load.py [--reps 3] [--json out.json]

A GPT2LMHeadModel of GPT2Config()'s shape (GPT-2 small: 12 x 768, context 1024, vocabulary
50257, tied head) with random weights is saved with `save_pretrained` into a temp folder (not
timed). Then, for each repetition, a FRESH process does what `build_model` does on a fresh start
with model.init_from: `HFFolder.open` (config.json, the safetensors header), the llmtrain `GPT`
of the folder's shape built without its random init (`model.uninitialized()`; the other mode keeps
the init, for comparison) and `load_weights` (tensor by tensor, one memory-mapped handle at a time).
The config's resolution before it (`apply_init_from`: the tokenizer read, the headers checked,
about 0.1 s) is not timed; the tokenizer.json written here is a stand-in that loading never reads.
Imports come first and are not timed. Memory is sampled every 2 ms from /proc/self/status while
loading: the peak RSS above the RSS just before (all of it: the model's tensors and the file's
mapped pages) and the peak anonymous RSS above its start (the model's own memory, which the page
cache cannot give back), each against the weights' size (the model.safetensors file). Targets:
< 5 s and < 2x. This needs transformers (to write the folder).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch
from llmtrain.config.schema import ModelConfig
from llmtrain.hf.folder import load_weights
from llmtrain.hf.init import open_folder
from llmtrain.model import GPT
from llmtrain.training.setup import folder_model

sys.path.insert(0, sys.argv[2])
from bench_hf_load import Sampler

torch.set_num_threads(int(sys.argv[3]))
sampler = Sampler()
sampler.start()
t0 = time.perf_counter()
cfg = ModelConfig(name="gpt2", init_from=sys.argv[1], **open_folder(sys.argv[1]).model_fields())
t1 = time.perf_counter()
if sys.argv[4] == "build_model":  # as build_model does it: the init skipped, then load_weights
    model = folder_model(cfg, cfg.vocab_size, torch.device("cpu"))
else:  # for comparison: the model with its random init, then overwritten
    model = GPT(cfg, cfg.vocab_size)
    load_weights(model, open_folder(sys.argv[1]))
t2 = time.perf_counter()
peaks = sampler.stop()
print(json.dumps({"open": t1 - t0, "build_and_load": t2 - t1, "total": t2 - t0, **peaks,
                  "params": sum(p.numel() for p in model.parameters())}))
"""


def _status() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


class Sampler:
    """The peak of the process's RSS (and its anonymous part) above their values at start()."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self.base = interval, {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.base = _status()
        self.peak = dict(self.base)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def _sample(self) -> None:
        for key, value in _status().items():
            self.peak[key] = max(self.peak[key], value)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self._sample()
        return {"rss_growth": self.peak["VmRSS"] - self.base["VmRSS"],
                "anon_growth": self.peak["RssAnon"] - self.base["RssAnon"]}


def save_gpt2(folder: Path) -> int:
    """GPT-2 small with random weights, as save_pretrained writes it; the weights' size in bytes."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config()).save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")  # open_folder wants one; loading never reads it
    return (folder / "model.safetensors").stat().st_size


def load_once(folder: Path, threads: int, mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(Path(__file__).parent), str(threads), mode],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


MODES = {
    "build_model": "as build_model does it (init skipped)",
    "random_init": "GPT() with its random init, then loaded",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    console = Console()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "gpt2"
        size = save_gpt2(folder)
        console.print(f"GPT-2 small saved: model.safetensors {size / 2**20:,.0f} MiB")
        for rep in range(args.reps):
            for mode in MODES:  # alternating, so drift in the machine's speed hits both alike
                r = load_once(folder, args.threads, mode)
                runs[mode].append(r)
                console.print(f"rep {rep + 1} {mode}: {r['total']:.2f}s (open {r['open']:.2f}s); RSS "
                              f"+{r['rss_growth'] / 2**20:,.0f} MiB, anonymous +{r['anon_growth'] / 2**20:,.0f} MiB")
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    params = int(med["build_model"]["params"])
    table = Table(title=f"model.init_from of GPT-2 small ({params:,} parameters, {size / 2**20:,.0f} MiB), medians")
    for col in ("path", "seconds (target < 5)", "peak RSS / weights (target < 2x)", "peak anonymous / weights"):
        table.add_column(col)
    for mode, m in med.items():
        table.add_row(MODES[mode], f"{m['total']:.2f}", f"{m['rss_growth'] / size:.2f}x",
                      f"{m['anon_growth'] / size:.2f}x")
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"weights_bytes": size, "median": med, "runs": runs}, indent=2))
    ours = med["build_model"]
    return 0 if ours["total"] < 5 and ours["rss_growth"] < 2 * size else 1


if __name__ == "__main__":
    sys.exit(main())
