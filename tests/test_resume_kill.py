"""Crash and signal tests through the real CLI: SIGKILL at random steps, SIGTERM, Ctrl-C twice."""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llmtrain.core.errors import EXIT_INTERRUPTED
from llmtrain.training.interrupts import StopRequest

from .conftest import TINY_CORPUS

STEPS = 30
RUN = [
    "data=text", f"data.path={TINY_CORPUS}", "data.tokenizer=char",
    "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "model.dropout=0.1",
    "micro_batch_size=2", "global_batch_size=8", f"max_steps={STEPS}", "eval_interval=10", "eval_batches=2",
    "log_interval=1", "threads=1", "checkpoint.every_steps=1", "checkpoint.keep_last=2",
]


def command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "llmtrain", "train", *RUN, f"hydra.run.dir={run_dir}"]


def logged_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(line)["step"] for line in lines if line.endswith("}") and '"kind": "train"' in line]
    return max(steps, default=0)


def start_and_wait_for_step(run_dir: Path, step: int, tmp_path: Path) -> subprocess.Popen:
    proc = subprocess.Popen(command(run_dir), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while logged_step(run_dir) < step:
        assert proc.poll() is None, f"the run ended before step {step}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.005)
    return proc


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("reference")
    subprocess.run(command(tmp / "run"), cwd=tmp, check=True, capture_output=True)
    return weights(tmp / "run")


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the uninterrupted run"


@pytest.mark.slow
def test_sigkill_at_ten_random_steps_then_resume_is_bitwise_exact(tmp_path: Path, reference: dict) -> None:
    """One run killed ten times: each start resumes what the SIGKILL before it left (a checkpoint
    may be half-written, mid-eval, mid-pruning) and is killed again at the next step; the last one
    finishes. Every kill is followed by a resume, as with one run per kill, at half the processes."""
    rng = random.Random(20261129)
    run_dir = tmp_path / "run"
    for kill_at in sorted(rng.sample(range(1, STEPS - 1), 10)):  # 1, 2, 6, 7, 10, 13, 14, 22, 24, 25
        proc = start_and_wait_for_step(run_dir, kill_at, tmp_path)
        proc.kill()  # SIGKILL: no handler runs, a checkpoint may be half-written
        proc.wait()
    resumed = subprocess.run(command(run_dir), cwd=tmp_path, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed" in resumed.stdout
    assert_same(weights(run_dir), reference)


@pytest.mark.slow
def test_sigterm_saves_prints_the_resume_command_and_exits_75(tmp_path: Path, reference: dict) -> None:
    run_dir = tmp_path / "run"
    proc = start_and_wait_for_step(run_dir, 5, tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, stderr
    assert "SIGTERM received" in stderr and "To resume exactly where it stopped" in stderr
    resume_line = stderr.strip().splitlines()[-1].strip()
    argv = shlex.split(resume_line)
    assert argv[:2] == ["llmtrain", "train"] and f"hydra.run.dir={run_dir}" in argv
    latest = (run_dir / "checkpoints" / "latest").read_text()
    assert int(latest.removeprefix("step_")) >= 5
    resumed = subprocess.run([sys.executable, "-m", "llmtrain", *argv[1:]], cwd=tmp_path, capture_output=True,
                             text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert_same(weights(run_dir), reference)


def test_second_ctrl_c_aborts_at_once() -> None:
    # The handler before: Python's default_int_handler, or SIG_IGN when the test runner was started
    # in the background of a non-interactive shell (which ignores SIGINT for background jobs).
    before = signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested(1) and stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before, "the previous handler is restored"
