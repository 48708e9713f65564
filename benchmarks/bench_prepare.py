"""Data preparation throughput and memory: MB of input per second and peak RSS, per tokenizer.

    python benchmarks/bench_prepare.py [--mb 64] [--reps 2] [--bpe-vocab 8192]

The corpus is Python's own stdlib sources (the embedded default's text), copied into files of
~1 MB until it holds `--mb` megabytes. Each repetition prepares it from scratch into a fresh cache
(`llmtrain.data.prepare.prepare_data`: scan, split, tokenizer fitting - BPE trains on a
`data.bpe_sample_bytes` sample -, encode, write, fsync, atomic rename) in a fresh Python process,
which reports its wall time and its peak RSS (VmHWM); the medians are shown. Preparation streams,
so the peak should not grow with `--mb`. The issue's targets on 2 cores: byte >= 50 MB/s,
BPE >= 5 MB/s (char has none).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from llmtrain.data.corpus import stdlib_files

TARGETS = {"byte": 50.0, "char": None, "bpe": 5.0}

# Run in a fresh interpreter per repetition: the peak RSS is this preparation's alone.
ONE_RUN = """
import json, sys, time
from llmtrain.config.schema import DataConfig, DataSource, TokenizerKind
from llmtrain.data.prepare import prepare_data
corpus, kind, vocab, cache = sys.argv[1:5]
cfg = DataConfig(source=DataSource.text, path=corpus, tokenizer=TokenizerKind(kind), bpe_vocab_size=int(vocab),
                 cache_dir=cache)
start = time.perf_counter()
meta = prepare_data(cfg, log=lambda message: None).meta
seconds = time.perf_counter() - start
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) * 1024
print(json.dumps({"seconds": seconds, "tokens": meta["train_tokens"] + meta["val_tokens"], "peak_bytes": peak}))
"""


def prepare_once(corpus: Path, kind: str, vocab: int, cache: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", ONE_RUN, str(corpus), kind, str(vocab), str(cache)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def make_corpus(folder: Path, megabytes: int, file_megabytes: int = 1) -> int:
    """Write ~`file_megabytes` MB text files from the stdlib sources until `megabytes` are written;
    returns the bytes written."""
    folder.mkdir(parents=True, exist_ok=True)
    sources = [f.path.read_bytes() for f in stdlib_files()]
    written, index, chunk = 0, 0, bytearray()
    while written < megabytes * 2**20:
        for data in sources:
            chunk += data
            if len(chunk) >= file_megabytes * 2**20 or written + len(chunk) >= megabytes * 2**20:
                (folder / f"part{index:05d}.txt").write_bytes(bytes(chunk))
                written += len(chunk)
                index += 1
                chunk = bytearray()
                if written >= megabytes * 2**20:
                    break
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=64, help="corpus size in MB (default 64)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions per tokenizer; the median is reported")
    parser.add_argument("--bpe-vocab", type=int, default=8192, help="BPE vocabulary size (default 8192)")
    parser.add_argument("--file-mb", type=int, default=1, help="size of each corpus file in MB (default 1)")
    parser.add_argument("--tokenizers", default="byte,char,bpe", help="comma-separated (default byte,char,bpe)")
    opts = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        size = make_corpus(corpus, opts.mb, opts.file_mb)
        table = Table(title=f"llmtrain prepare: {size / 2**20:.0f} MB of text in {len(list(corpus.iterdir()))} files")
        for column in ("tokenizer", "median s", "MB/s", "target MB/s", "tokens", "peak RSS MB", "met"):
            table.add_column(column)
        for kind in opts.tokenizers.split(","):
            runs = [prepare_once(corpus, kind, opts.bpe_vocab, Path(tmp) / f"cache-{kind}-{rep}")
                    for rep in range(opts.reps)]
            seconds = statistics.median(r["seconds"] for r in runs)
            peak = statistics.median(r["peak_bytes"] for r in runs)
            rate = size / 2**20 / seconds
            target = TARGETS[kind]
            table.add_row(kind, f"{seconds:.2f}", f"{rate:.1f}", f"{target:g}" if target else "-",
                          f"{runs[0]['tokens']:,}", f"{peak / 2**20:.0f}",
                          "-" if target is None else "yes" if rate >= target else "NO")
        console.print(table)


if __name__ == "__main__":
    main()
