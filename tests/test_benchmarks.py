"""The step benchmark still runs against the current config and loop (a config default that
changed, optim.lr=null, once broke its bare loop unnoticed). It measures nothing here: speed is
read from its own output on a quiet machine (docs/performance.md), never asserted in a test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_step_runs_both_loops(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--steps", "4", "--warmup", "2", "--reps", "1",
         "--json", str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    assert len(figures["bare_s"]) == len(figures["llmtrain_s"]) == 1
    assert figures["bare_s"][0] > 0 and figures["llmtrain_s"][0] > 0 and figures["ratio"] > 0


@pytest.mark.slow
def test_bench_eval_runs_both_paths(tmp_path: Path) -> None:
    """The evaluation benchmark still drives the perplexity task and its bare loop (2 windows)."""
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_eval.py"), "--shapes", "tiny", "--windows", "2",
         "--batch-size", "2", "--reps", "1", "--no-memory", "--json", str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (figures,) = json.loads(out.read_text())
    assert figures["tokens"] == 2 * 256 and figures["parameters_with_grad"] == 0
    assert figures["loss_difference"] < 1e-4  # both paths scored the same windows
    assert figures["tokens_per_s"]["bare"] > 0 and figures["tokens_per_s"]["llmtrain"] > 0


@pytest.mark.slow
def test_bench_sample_runs_both_loops_and_the_command(tmp_path: Path) -> None:
    """The sampling benchmark still drives generate, its bare cached loop (past the 256-token
    window: the refill too) and `llmtrain sample`, on a default-shaped run it writes itself."""
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_sample.py"), "--tokens", "270", "--reps", "1",
         "--wall-reps", "1", "--json", str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    assert figures["context"] == 256 and [r["temperature"] for r in figures["generation"]] == [0.0, 1.0]
    assert all(r["same_tokens"] and r["ratio"] > 0 for r in figures["generation"])  # same tokens: same refills
    assert all(len(times) == 1 and times[0] > 0 for times in figures["wall_s"].values())
