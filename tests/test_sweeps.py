"""Sweeps through Hydra's plugins: submitit's local launcher runs the jobs (the SLURM launcher's
stand-in), Optuna's sweeper searches the learning rate; both end with `llmtrain compare`."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import TINY_CORPUS, run_cli

TINY = ["data=text", f"data.path={TINY_CORPUS}", "data.tokenizer=char", "model.n_layer=1", "model.n_embd=32",
        "model.n_head=2", "model.block_size=32", "micro_batch_size=4", "global_batch_size=8", "max_steps=20",
        "schedule.warmup_steps=2", "eval_interval=10", "log_interval=10", "threads=1"]


def llmtrain(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`llmtrain ARGS` in this process (conftest.run_cli: the same output, no new interpreter)."""
    return run_cli(*args, cwd=cwd, columns=200)


def llmtrain_process(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m llmtrain ARGS` in a subprocess: submitit's jobs are processes of their own, which
    end with this one (conftest's session), not with an in-process call."""
    return subprocess.run([sys.executable, "-m", "llmtrain", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "COLUMNS": "200"})


def compared(sweep: Path) -> list[dict]:
    with open(sweep / "compare.csv") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
def test_submitit_local_launcher_runs_a_two_job_sweep(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    proc = llmtrain_process(tmp_path, "train", "-m", "hydra/launcher=submitit_local", "optim.lr=1e-3,1e-2", *TINY,
                    f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr
    assert (sweep / ".submitit").is_dir(), "the jobs went through submitit"
    rows = compared(sweep)
    assert sorted(r["overrides"] for r in rows) == ["optim.lr=0.001", "optim.lr=0.01"]
    assert all(r["status"] == "finished" for r in rows)


@pytest.mark.slow
def test_the_tasks_of_a_submitit_job_are_the_ranks_of_one_run(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    proc = llmtrain_process(tmp_path, "train", "-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
                    "parallel=ddp", *TINY, f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr
    task_logs = sorted((sweep / ".submitit").glob("*/*_0_log.out"))
    assert "(world size 2, DDP over gloo)" in task_logs[0].read_text(), "task 0 is rank 0 of 2"
    single = llmtrain(tmp_path, "train", *TINY, f"hydra.run.dir={tmp_path / 'single'}")
    assert single.returncode == 0, single.stderr
    losses = [{r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if r["kind"] == "train"} for run in (tmp_path / "single", sweep / "0")]
    assert losses[0].keys() == losses[1].keys() == {10, 20}
    assert all(losses[1][k] == pytest.approx(losses[0][k], rel=1e-5) for k in losses[0])


def test_each_task_of_a_submitit_job_becomes_a_rank_as_torchrun_would_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the slow test above shows through real jobs, on submitit's job environment alone: task
    3 of a job of 4 tasks on 2 nodes is rank 3, local rank 1 of 2, meeting at the first node."""
    submitit = pytest.importorskip("submitit")
    from types import SimpleNamespace

    from llmtrain.training.launch import ranks_from_submitit_tasks

    job = SimpleNamespace(num_tasks=4, global_rank=3, local_rank=1, num_nodes=2, hostnames=["node-a", "node-b"],
                          job_id="4242")
    monkeypatch.setattr(submitit, "JobEnvironment", lambda: job)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # recorded, so that what the call sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    ranks_from_submitit_tasks()
    assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node-a"}
    port = os.environ["MASTER_PORT"]
    assert 20000 <= int(port) < 40000
    for name in ("RANK", "WORLD_SIZE"):  # the first task of the same job, in its own process: the same port
        monkeypatch.delenv(name)
    job.global_rank, job.local_rank = 0, 0
    ranks_from_submitit_tasks()
    assert os.environ["RANK"] == "0" and os.environ["MASTER_PORT"] == port
    # a job of one task, or no submitit at all: nothing is set
    monkeypatch.delenv("WORLD_SIZE")
    job.num_tasks = 1
    ranks_from_submitit_tasks()
    assert "WORLD_SIZE" not in os.environ


def test_the_shipped_slurm_launcher_config_composes(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    proc = llmtrain(tmp_path, "train", "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "--cfg", "hydra")
    assert proc.returncode == 0, proc.stderr
    launcher = yaml.safe_load(proc.stdout)["hydra"]["launcher"]
    assert launcher["_target_"].endswith("SlurmLauncher")
    assert launcher["partition"] == "gpu" and launcher["timeout_min"] == 240 and launcher["tasks_per_node"] == 1


def test_optuna_searches_the_learning_rate_for_a_few_trials(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    proc = llmtrain(tmp_path, "train", "-m", "hydra/sweeper=lr_search", "hydra.sweeper.n_trials=3",
                    "schedule.warmup_steps=2", *TINY, f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    rows = compared(sweep)
    assert len(rows) == 3 and all("optim.lr=" in r["overrides"] for r in rows)
    # each trial's objective is its final validation loss: the best one is the table's first row
    assert result["best_value"] == pytest.approx(float(rows[0]["final_val_loss"]))
    assert 1e-4 <= result["best_params"]["optim.lr"] <= 3e-2
