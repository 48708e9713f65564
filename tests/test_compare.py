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


def fake_run(root: Path, name: str, tokenizer: dict, val_loss: float, bits_per_byte: float | None = None) -> Path:
    """A run dir as `llmtrain train` leaves it, as far as compare reads it: metrics.jsonl (an eval
    task's bits per byte among its records when given), config.yaml and tokenizer.json."""
    run = root / name
    run.mkdir(parents=True)
    records = [{"kind": "train", "step": 10, "loss": val_loss + 0.1},
               {"kind": "eval", "step": 10, "val_loss": val_loss}]
    if bits_per_byte is not None:
        records.append({"kind": "eval_task", "step": 10, "task": "perplexity:validation", "loss": val_loss,
                        "bits_per_byte": bits_per_byte})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "config.yaml").write_text(f"data:\n  tokenizer: {tokenizer['kind']}\nlog_interval: 10\n")
    (run / "tokenizer.json").write_text(json.dumps(tokenizer))
    return run


BYTE = {"kind": "byte"}
CHAR = {"kind": "char", "chars": "abc", "end_of_text": True}


def test_runs_of_one_tokenizer_sort_by_validation_loss_without_a_note(tmp_path: Path) -> None:
    from llmtrain.runs.compare import COLUMNS, columns, compare_runs, ranking

    fake_run(tmp_path, "a", BYTE, 2.0)
    fake_run(tmp_path, "b", BYTE, 1.5)
    summaries, _ = compare_runs(tmp_path)
    assert [s.run_dir.name for s in summaries] == ["b", "a"]
    assert ranking(summaries).note is None and columns(summaries) == list(COLUMNS)


def test_runs_of_different_tokenizers_are_said_not_to_compare_by_their_losses(tmp_path: Path) -> None:
    from llmtrain.runs.compare import columns, compare_runs, ranking, rows

    fake_run(tmp_path, "bytes", BYTE, 4.7)
    fake_run(tmp_path, "chars", CHAR, 3.6)
    fake_run(tmp_path, "chars_other_text", {**CHAR, "chars": "xyz"}, 3.5)  # one kind fitted to other text
    summaries, _ = compare_runs(tmp_path)
    note = ranking(summaries).note
    assert note is not None and "different tokenizers" in note and "do not compare, nor does this order" in note
    assert "llmtrain eval RUN_DIR" in note
    names = dict(zip((s.run_dir.name for s in summaries), (row[6] for row in rows(summaries, tmp_path))))
    assert (names["bytes"] == "byte" and names["chars"].startswith("char #")
            and names["chars"] != names["chars_other_text"])
    assert "tokenizer" in columns(summaries)


def test_runs_of_different_tokenizers_sort_by_bits_per_byte_where_they_have_it(tmp_path: Path) -> None:
    from llmtrain.runs.compare import columns, compare_runs, ranking, write_csv

    fake_run(tmp_path, "bytes", BYTE, 1.1, bits_per_byte=1.6)  # lower nats/token, but more tokens per byte
    fake_run(tmp_path, "chars", CHAR, 1.3, bits_per_byte=1.4)
    fake_run(tmp_path, "unscored", CHAR, 0.9)
    summaries, _ = compare_runs(tmp_path)
    assert [s.run_dir.name for s in summaries] == ["chars", "bytes", "unscored"]
    order = ranking(summaries)
    assert order.task == "perplexity:validation" and "sorted by bits per byte on perplexity:validation" in order.note
    assert "the 1 run without that score come last" in order.note
    assert "bits/byte (perplexity:validation)" in columns(summaries)
    write_csv(summaries, tmp_path, tmp_path / "compare.csv")
    with open(tmp_path / "compare.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [(row["run"], row["tokenizer"], row["bits_per_byte"]) for row in table] == [
        ("chars", "char", "1.4"), ("bytes", "byte", "1.6"), ("unscored", "char", "")]
    proc = llmtrain(tmp_path, "compare", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "note: the runs use different tokenizers (char: 2 runs, byte: 1 run)" in proc.stdout
