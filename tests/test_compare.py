"""A real sweep (`llmtrain train -m`) ends with `llmtrain compare`'s table; the CSV and PNG load."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest

from .conftest import TINY_CORPUS, run_cli

TINY = ["data=text", f"data.path={TINY_CORPUS}", "data.tokenizer=char", "model.n_layer=1", "model.n_embd=32",
        "model.n_head=2", "model.block_size=32", "micro_batch_size=4", "global_batch_size=8", "max_steps=20",
        "schedule.warmup_steps=2", "eval_interval=10", "log_interval=5", "threads=1"]


def llmtrain(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    """`llmtrain ARGS` in this process (conftest.run_cli: the same output, no new interpreter)."""
    return run_cli(*args, cwd=cwd, env=env, columns=200)


def test_a_learning_rate_sweep_ends_with_the_comparison(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = llmtrain(tmp_path, "train", "-m", "optim.lr=1e-3,3e-3,1e-2", *TINY, f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr
    assert "3 runs in" in proc.stdout and f"wrote {sweep / 'compare.csv'}" in proc.stdout
    with open(sweep / "compare.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [row["overrides"] for row in table] == ["optim.lr=0.01", "optim.lr=0.003", "optim.lr=0.001"]
    finals = [float(row["final_val_loss"]) for row in table]
    assert finals == sorted(finals)  # best first
    for row in table:  # the numbers are the runs' own last records
        records = [json.loads(line) for line in Path(row["run_dir"], "metrics.jsonl").read_text().splitlines()]
        assert float(row["final_val_loss"]) == [r for r in records if r["kind"] == "eval"][-1]["val_loss"]
        assert row["status"] == "finished" and float(row["tokens_per_s"]) > 0

    import matplotlib.image

    image = matplotlib.image.imread(sweep / "compare.png")
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 500


def test_a_sweep_without_a_sweep_dir_gets_hydras_default_and_its_comparison(tmp_path: Path) -> None:
    proc = llmtrain(tmp_path, "train", "-m", "optim.lr=1e-3,1e-2", *TINY, "max_steps=6", "eval_interval=3")
    assert proc.returncode == 0, proc.stderr
    sweeps = list((tmp_path / "multirun").glob("*/*"))
    assert len(sweeps) == 1 and (sweeps[0] / "compare.csv").is_file() and (sweeps[0] / "0" / "model.pt").is_file()


def test_compare_shows_an_unfinished_run_last_and_refuses_a_folder_without_runs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    done = llmtrain(tmp_path, "train", *TINY, f"hydra.run.dir={sweep / 'done'}")
    stopped = llmtrain(tmp_path, "train", *TINY, "eval_interval=0", f"hydra.run.dir={sweep / 'stopped'}",
                       env={"LLMTRAIN_TEST_STOP_AT_STEP": "7"})
    assert done.returncode == 0 and stopped.returncode == 75
    proc = llmtrain(tmp_path, "compare", str(sweep))
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "│" in line]
    assert "finished" in lines[0] and "stopped at 7/20" in lines[1]
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (empty, tmp_path / "missing"):
        bad = llmtrain(tmp_path, "compare", str(folder))
        assert bad.returncode == 2 and "Traceback" not in bad.stderr


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_losses_sort_last(tmp_path: Path, value: str) -> None:
    from llmtrain.runs.compare import compare_runs

    for name, val in (("a", value), ("b", 2.5)):
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 3.0}) + "\n"
                                           + json.dumps({"kind": "eval", "step": 1, "val_loss": val}) + "\n")
    summaries, _ = compare_runs(tmp_path)
    assert [s.run_dir.name for s in summaries] == ["b", "a"]
