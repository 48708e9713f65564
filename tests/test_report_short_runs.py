"""Plots on short runs (issue 20, point 6): a run of 50 steps has an activation curve; a plot with
nothing to show is left out, and report.md and report.html say why in one line; compare of runs
too short for curves writes its table and CSV, and no compare.png, with the reason."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console

from llmtrain.config.schema import ModelConfig, MonitorConfig, config_to_dict
from llmtrain.core.errors import Interrupted
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.metrics.writer import NullMetricsWriter
from llmtrain.model import GPT
from llmtrain.monitor.cadence import activation_every, samples_expected
from llmtrain.monitor.watch import Monitor
from llmtrain.runs.compare import compare_runs, plot_curves, write_csv
from llmtrain.runs.report import write_report
from llmtrain.training.loop import train

from .conftest import run_cli, tiny_config


def sampled_steps(run_dir: Path) -> list[int]:
    """The steps whose health record carries activation statistics, as metrics.jsonl has them."""
    return [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "health" and "activation_mean" in r]


def write_run(run_dir: Path, records: list[dict], **config: object) -> Path:
    """A run dir from synthesized records: metrics.jsonl and config.yaml (the tiny config with `config`)."""
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = tiny_config(run_dir, **config)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg)))
    return run_dir


def short_run(steps: int, log_interval: int = 10, monitor_interval: int = 10,
              activations: tuple[int, ...] = ()) -> list[dict]:
    """The records of a run of `steps` steps: train records every log_interval and at the end, health
    checks every monitor_interval (with activations at `activations`), one evaluation at the end."""
    records: list[dict] = [{"kind": "start", "steps": steps, "step": 0, "unigram_entropy": 3.0}]
    for step in range(1, steps + 1):
        if step % monitor_interval == 0:
            health = {"kind": "health", "step": step, "loss": 4.0 - step / 100, "grad_norm": 1.0, "param_norm": 30.0,
                      "lr_applied": 1e-3, "lr_schedule": 1e-3, "rss_mb": 500.0}
            if step in activations:
                health |= {"activation_mean": [0.1, 0.2], "activation_var": [1.0, 2.0]}
            records.append(health)
        if step % log_interval == 0 or step == steps:
            records.append({"kind": "train", "step": step, "loss": 4.0 - step / 100, "lr": 1e-3, "grad_norm": 1.0,
                            "tokens_per_s": 1000.0, "tokens": 256 * step, "elapsed_s": step * 0.1})
    records.append({"kind": "eval", "step": steps, "val_loss": 3.9})
    return records


# ---- the cadence ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("interval", "activation_interval", "steps", "every", "samples"), [
    (10, 20, 1000, 20, 50),  # a long run: monitor.activation_interval as set
    (10, 20, 100, 20, 5),
    (10, 20, 99, 10, 9),  # too short for 5 samples every 20: every check
    (10, 20, 50, 10, 5),
    (10, 20, 49, 10, 4),
    (10, 20, 12, 10, 1),  # a single check: one sample
    (5, 50, 49, 5, 9),  # monitor=strict
    (5, 50, 1000, 50, 20),
    (10, 25, 240, 40, 6),  # 25 is no multiple of 10: samples on checks only, every 50, denser here
])
def test_the_cadence_gives_a_short_run_enough_samples_on_check_steps(
        interval: int, activation_interval: int, steps: int, every: int, samples: int) -> None:
    cfg = MonitorConfig(interval=interval, activation_interval=activation_interval)
    assert activation_every(cfg, steps) == every and every % interval == 0
    assert samples_expected(cfg, steps) == samples
    assert samples_expected(MonitorConfig(enabled=False), steps) == 0


def test_the_watch_samples_on_the_cadence_steps(tmp_path: Path) -> None:
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32), 16)
    watch = Monitor(MonitorConfig(), model, tmp_path, Dashboard(0, Console(file=io.StringIO())), NullMetricsWriter(),
                        total_steps=50, write_events=False)
    sampled = []
    for step in range(1, 51):
        watch.before_forward(step)
        if watch.probe is not None:
            sampled.append(step)
        watch.after_forward(torch.zeros(()))  # removes the hooks
        watch.skip_check()
    assert sampled == [10, 20, 30, 40, 50]


@pytest.mark.slow
def test_a_50_step_run_has_an_activation_curve_and_its_resume_samples_the_same_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = tmp_path / "reference"
    train(tiny_config(reference, max_steps=50, log_interval=10))
    assert sampled_steps(reference) == [10, 20, 30, 40, 50]
    report = write_report(reference, inference=False)
    assert "activations.png" in report.plots and (reference / "report" / "activations.png").is_file()
    markdown = (reference / "report.md").read_text()
    assert "![activations.png](report/activations.png)" in markdown
    assert list(report.left_out) == ["step_time.png"], report.left_out  # 50 steps: none timed (every 50th from 51)

    run = tmp_path / "run"
    monkeypatch.setenv("LLMTRAIN_TEST_STOP_AT_STEP", "25")
    with pytest.raises(Interrupted):
        train(tiny_config(run, max_steps=50, log_interval=10))
    monkeypatch.delenv("LLMTRAIN_TEST_STOP_AT_STEP")
    train(tiny_config(run, max_steps=50, log_interval=10))

    def activations(run_dir: Path) -> dict[int, list[float]]:
        logged = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["activation_var"] for r in logged if r["kind"] == "health" and "activation_var" in r}

    assert sampled_steps(run) == [10, 20, 30, 40, 50]
    assert activations(run) == activations(reference), "the same steps, the same values: sampling moved nothing"


# ---- plots left out ------------------------------------------------------------------------------------

def test_a_run_without_activation_samples_leaves_the_plot_out_and_says_why(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", short_run(12), max_steps=12, log_interval=10)
    report = write_report(run, inference=False)
    folder = run / "report"
    line = ("activations.png: left out: only 1 activation sample at step 10 (the monitor samples activations every 10 "
            "steps on a 12-step run: denser than monitor.activation_interval=20, for 5 samples; this run took 12 "
            "steps)")
    assert report.left_out["activations.png"].startswith(line.replace("only 1 activation sample at step 10",
                                                                      "no activation samples"))
    markdown, page = (run / "report.md").read_text(), (run / "report.html").read_text()
    for name in ("activations.png", "loss.png", "lr.png", "grad_norm.png", "param_norm.png", "memory.png",
                 "throughput.png"):
        assert not (folder / name).exists() and name not in report.plots, name
        assert f"![{name}]" not in markdown and f'alt="{name}"' not in page, name
        assert f"*{report.left_out[name]}*" in markdown, name
        assert report.left_out[name] in page.replace("&#x27;", "'"), name
    assert "data:image/png" not in page
    assert report.left_out["loss.png"] == (
        "loss.png: left out: only 2 logged train losses (one every log_interval=10 steps and at the end; this run "
        "took 12 steps): too few for a curve; log_interval=2 gives 6")
    assert report.left_out["param_norm.png"].startswith("param_norm.png: left out: only 1 parameter norm reading (the "
                                                        "monitor checks every monitor.interval=10 steps")

    with_one = write_run(tmp_path / "one", short_run(12, activations=(10,)), max_steps=12, log_interval=10)
    assert write_report(with_one, inference=False).left_out["activations.png"].startswith(line)


def test_a_plot_left_out_removes_the_png_of_an_earlier_report(tmp_path: Path) -> None:
    checks = [r for r in short_run(40, monitor_interval=5, activations=(10, 20, 30, 40)) if r["kind"] != "train"]
    run = write_run(tmp_path / "run", checks, max_steps=40, **{"monitor.interval": 5})
    assert "activations.png" in write_report(run, inference=False).plots
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in checks if r.get("step", 0) < 20))
    again = write_report(run, inference=False)
    assert again.left_out["activations.png"].startswith(
        "activations.png: left out: only 1 activation sample at step 10")
    assert not (run / "report" / "activations.png").exists(), "the first report's plot would pass for this run's"


def test_with_the_monitor_off_the_health_plots_say_so(tmp_path: Path) -> None:
    records = [r for r in short_run(40, log_interval=5) if r["kind"] != "health"]
    run = write_run(tmp_path / "run", records, max_steps=40, log_interval=5, **{"monitor.enabled": False})
    report = write_report(run, inference=False)
    assert report.left_out["activations.png"] == ("activations.png: left out: no activation samples: the monitor was "
                                                  "off (monitor.enabled=false)")
    assert report.left_out["param_norm.png"].endswith("the monitor was off (monitor.enabled=false)")
    assert {"loss.png", "lr.png", "grad_norm.png", "throughput.png"} <= set(report.plots)
    assert report.left_out["step_time.png"] == (
        "step_time.png: left out: no step was timed (every timing_interval=50-th step is, from step 51 on; this run "
        "took 40 steps); timing_interval=13 times 3")


def test_the_task_plot_needs_three_evaluations(tmp_path: Path) -> None:
    def with_tasks(name: str, steps: list[int]) -> Path:
        tasks = [{"kind": "eval_task", "step": s, "task": "perplexity:held.txt", "loss": 3.0 - s / 100,
                  "perplexity": 20.0, "tokens": 100} for s in steps]
        ends = [{"kind": "start", "steps": 30, "step": 0}, {"kind": "train", "step": 30, "loss": 3.0}]
        return write_run(tmp_path / name, ends + tasks, max_steps=30, log_interval=5, eval_interval=10)

    drawn = write_report(with_tasks("three", [10, 20, 30]), inference=False)
    assert "eval_tasks.png" in drawn.plots and "![eval_tasks.png](report/eval_tasks.png)" in (
        tmp_path / "three" / "report.md").read_text()
    one = write_report(with_tasks("one", [30]), inference=False)
    assert one.left_out["eval_tasks.png"] == (
        "eval_tasks.png: left out: only 1 evaluation of the tasks (at every evaluation: every eval_interval=10 steps "
        "and at the end; this run took 30 steps): too few for a curve; eval_interval=6 gives 5")
    evaluation_section = (tmp_path / "one" / "report.md").read_text().split("## Evaluation")[1]
    assert f"*{one.left_out['eval_tasks.png']}*" in evaluation_section


# ---- compare -------------------------------------------------------------------------------------------

def test_compare_of_two_point_runs_writes_the_table_and_says_why_there_is_no_plot(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    for job, lr in (("0", 1e-3), ("1", 3e-3)):
        write_run(sweep / job, short_run(20), max_steps=20, log_interval=10, **{"optim.lr": lr})
    summaries, _ = compare_runs(sweep)
    reason = plot_curves(summaries, sweep / "compare.png", "2 runs")
    assert reason == ("compare.png: left out: at most 2 logged losses per run (log_interval=10; runs of 20 steps): "
                      "too few for curves; log_interval=4 gives 5")
    assert not (sweep / "compare.png").exists()
    proc = run_cli("compare", str(sweep), cwd=tmp_path, columns=300)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {sweep / 'compare.csv'}; {reason}" in proc.stdout
    with open(sweep / "compare.csv") as fh:
        assert [row["final_val_loss"] for row in csv.DictReader(fh)] == ["3.9", "3.9"]
    write_csv(summaries, sweep, tmp_path / "again.csv")
    assert (tmp_path / "again.csv").read_text() == (sweep / "compare.csv").read_text()

    longer = tmp_path / "longer"
    write_run(longer / "0", short_run(20, log_interval=5), max_steps=20, log_interval=5)
    assert plot_curves(compare_runs(longer)[0], longer / "compare.png", "1 run") is None
    assert (longer / "compare.png").stat().st_size > 0

