"""Options the checklist and presets rely on: an unseeded run, unshuffled and replayed data,
deterministic algorithms, precision=auto and compile=auto on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from llmtrain.config.schema import CompileMode, Precision
from llmtrain.data.sampler import RandomWindowSampler
from llmtrain.engine.precision import resolve_precision
from llmtrain.training.loop import train

from .conftest import tiny_config

TOKENS = np.arange(1000, dtype=np.uint16)


def test_unshuffled_windows_follow_the_corpus_and_split_like_one_batch() -> None:
    one = RandomWindowSampler(TOKENS, 4, 10, seed=0, shuffle=False)
    x, y = one.next_batch()
    assert x[:, 0].tolist() == [0, 10, 20, 30] and torch.equal(y[:, :-1], x[:, 1:])
    two = RandomWindowSampler(TOKENS, 2, 10, seed=0, shuffle=False)
    assert torch.equal(torch.cat([two.next_batch()[0], two.next_batch()[0]]), x)


def test_overfit_batches_replays_the_first_batches_and_resumes_exactly() -> None:
    sampler = RandomWindowSampler(TOKENS, 3, 8, seed=5, overfit_batches=2)
    first, second = sampler.next_batch()[0], sampler.next_batch()[0]
    assert not torch.equal(first, second)
    assert torch.equal(sampler.next_batch()[0], first) and torch.equal(sampler.next_batch()[0], second)
    state = json.loads(json.dumps(sampler.state_dict()))
    resumed = RandomWindowSampler(TOKENS, 3, 8, seed=5, overfit_batches=2)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_batch()[0], sampler.next_batch()[0])


def test_unseeded_run_draws_a_seed_and_logs_it(tmp_path: Path) -> None:
    train(tiny_config(tmp_path / "a", seed=None, max_steps=3))
    train(tiny_config(tmp_path / "b", seed=None, max_steps=3))
    seeds = [json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[0])["seed"] for run in "ab"]
    assert all(isinstance(s, int) for s in seeds) and seeds[0] != seeds[1]


def test_deterministic_run_repeats_bit_for_bit(tmp_path: Path) -> None:
    try:
        a = train(tiny_config(tmp_path / "a", deterministic=True, max_steps=4, **{"model.dropout": 0.1}))
        b = train(tiny_config(tmp_path / "b", deterministic=True, max_steps=4, **{"model.dropout": 0.1}))
    finally:
        torch.use_deterministic_algorithms(False)  # belt and braces: the next train() resets it anyway
    assert a.train_losses == b.train_losses


def test_auto_precision_and_compile_on_cpu_train_in_plain_fp32(tmp_path: Path) -> None:
    assert resolve_precision(Precision.auto, torch.device("cpu")) is Precision.fp32
    result = train(tiny_config(tmp_path / "run", max_steps=3, compile=CompileMode.auto,
                               **{"precision.name": Precision.auto}))
    assert result.steps == 3
    reference = train(tiny_config(tmp_path / "ref", max_steps=3))
    assert result.train_losses == reference.train_losses  # auto on CPU == fp32, no compile


def test_a_drawn_seed_survives_a_resume(tmp_path: Path, monkeypatch) -> None:
    import pytest

    from llmtrain.core.errors import Interrupted

    run = tmp_path / "run"
    monkeypatch.setenv("LLMTRAIN_TEST_STOP_AT_STEP", "3")
    with pytest.raises(Interrupted):
        train(tiny_config(run, seed=None, max_steps=6, eval_interval=3, eval_batches=1))
    monkeypatch.delenv("LLMTRAIN_TEST_STOP_AT_STEP")
    resumed = train(tiny_config(run, seed=None, max_steps=6, eval_interval=3, eval_batches=1))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    starts = [r for r in records if r["kind"] == "start"]
    assert len(starts) == 2 and starts[0]["seed"] == starts[1]["seed"]  # same validation batches after resume
    assert resumed.steps == 6


def test_deterministic_mode_does_not_leak_into_the_next_run(tmp_path: Path) -> None:
    train(tiny_config(tmp_path / "a", deterministic=True, max_steps=3))
    assert torch.are_deterministic_algorithms_enabled()
    train(tiny_config(tmp_path / "b", max_steps=3))
    assert not torch.are_deterministic_algorithms_enabled()


def test_threads_share_the_cores_between_local_ranks_unless_slurm_gave_each_task_its_own(monkeypatch) -> None:
    from llmtrain.distributed import layout as parallel

    monkeypatch.setattr(parallel, "usable_cores", lambda: 16)
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert parallel.default_threads() == 4  # torchrun: four ranks share the machine's 16 cores
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    assert parallel.default_threads() == 8  # a SLURM task owns its cpus_per_task cores


FLUSH_PROBE = (
    "import sys, torch; from llmtrain.cli.common import flush_denormals_first; flush_denormals_first(sys.argv[1:]); "
    "torch.set_num_threads(2); x = torch.randn(300, 300); (x @ x).sum(); "
    "a = torch.full((512, 512), 1e-20); print(int((a @ a != 0).sum()))"  # every product is 1e-40: subnormal
)


@pytest.mark.slow  # two fresh processes
def test_subnormals_are_flushed_on_every_thread_before_any_compute() -> None:
    import subprocess
    import sys

    def nonzero(*overrides: str) -> int:
        proc = subprocess.run([sys.executable, "-c", FLUSH_PROBE, *overrides], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.strip())

    # Set after the thread pool exists, the switch reached only the main thread (half the rows stayed
    # subnormal, and a matmul on subnormals ran 60x slower): llmtrain sets it before any compute.
    assert nonzero() == 0
    assert nonzero("flush_denormal=false") == 512 * 512
