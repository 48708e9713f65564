"""Data preparation throughput: MB of input per second, per tokenizer, on a folder of text files.

    python benchmarks/bench_prepare.py [--mb 64] [--reps 2] [--bpe-vocab 8192]

The corpus is Python's own stdlib sources (the embedded default's text), copied into files of
~1 MB until it holds `--mb` megabytes. Each repetition prepares it from scratch into a fresh cache
(`llmtrain.data.prepare.prepare_data`: read, decode, split, tokenizer training for bpe, encode,
write, fsync, atomic rename) and the median wall time gives MB/s. The issue's targets on 2 cores:
byte >= 50 MB/s, BPE >= 5 MB/s. Nothing else runs in the timed region.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from llmtrain.config import DataConfig, DataSource, TokenizerKind
from llmtrain.data.corpus import stdlib_files
from llmtrain.data.prepare import prepare_data

TARGETS = {"byte": 50.0, "bpe": 5.0}


def make_corpus(folder: Path, megabytes: int) -> int:
    """Write ~1 MB text files from the stdlib sources until `megabytes` are written; returns bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    sources = [f.path.read_bytes() for f in stdlib_files()]
    written, index, chunk = 0, 0, bytearray()
    while written < megabytes * 2**20:
        for data in sources:
            chunk += data
            if len(chunk) >= 2**20:
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
    opts = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        size = make_corpus(corpus, opts.mb)
        table = Table(title=f"llmtrain prepare: {size / 2**20:.0f} MB of text in {len(list(corpus.iterdir()))} files")
        for column in ("tokenizer", "median s", "MB/s", "target MB/s", "tokens", "met"):
            table.add_column(column)
        for kind in (TokenizerKind.byte, TokenizerKind.bpe):
            times, meta = [], {}
            for rep in range(opts.reps):
                cfg = DataConfig(source=DataSource.text, path=str(corpus), tokenizer=kind, bpe_vocab_size=opts.bpe_vocab,
                                 cache_dir=str(Path(tmp) / f"cache-{kind.value}-{rep}"))
                start = time.perf_counter()
                meta = prepare_data(cfg, log=lambda message: None).meta
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            rate = size / 2**20 / seconds
            table.add_row(kind.value, f"{seconds:.2f}", f"{rate:.1f}", f"{TARGETS[kind.value]:g}",
                          f"{meta['train_tokens'] + meta['val_tokens']:,}", "yes" if rate >= TARGETS[kind.value] else "NO")
        console.print(table)


if __name__ == "__main__":
    main()
