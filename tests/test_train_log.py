"""train.log: what a run showed, as plain text in its run dir (the banner, the step and eval lines,
the summary, the review, a stop and its resume command), appended to by a resumed run; a live
progress bar's redraws and terminal codes are left out, and a refused job writes nothing."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmtrain.core import rundir
from llmtrain.core.console import LoggedConsole
from llmtrain.core.errors import EXIT_INTERRUPTED
from llmtrain.metrics.dashboard import Dashboard

from .conftest import run_cli
from .test_cli_run import TINY


def log_lines(run_dir: Path) -> list[str]:
    text = (run_dir / "train.log").read_text(encoding="utf-8")
    assert "\x1b" not in text and "\r" not in text, "plain text: no terminal control codes"
    return text.splitlines()


def test_train_log_holds_what_the_run_showed_and_a_resume_appends(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # A cache of its own: the data is prepared in this run (another test may have prepared it already)
    first = run_cli("train", *TINY, "max_steps=4", f"hydra.run.dir={run_dir}", cwd=tmp_path,
                    env={"LLMTRAIN_CACHE": str(tmp_path / "cache")})
    assert first.returncode == 0, first.stderr
    lines = log_lines(run_dir)
    banner = f"llmtrain: gpt_tiny on text -> {run_dir}"
    assert banner in lines and banner in first.stdout.splitlines()
    assert lines[0].startswith("preparing text data"), "a line from before the run was accepted is kept"
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["1/4", "2/4", "3/4", "4/4"]
    assert [line for line in lines if line.startswith("eval step")] == [
        line for line in first.stdout.splitlines() if line.startswith("eval step")]
    done = [line for line in lines if line.startswith("done: step 4, ")]
    assert len(done) == 1 and done[0].endswith(f"Weights: {run_dir / 'model.pt'}")
    assert lines[-1].startswith("post-run review: ")
    assert not [line for line in lines if line.startswith("[")], "no logging-format lines for console output"

    resumed = run_cli("train", *TINY, "max_steps=6", f"hydra.run.dir={run_dir}", cwd=tmp_path,
                      env={"LLMTRAIN_CACHE": str(tmp_path / "cache")})
    assert resumed.returncode == 0, resumed.stderr
    after = log_lines(run_dir)
    assert after[:len(lines)] == lines, "a resumed run appends"
    added = after[len(lines):]
    assert banner in added and any(line.startswith("resumed from ") for line in added)
    assert [line.split()[1] for line in added if line.startswith("step ")] == ["5/6", "6/6"]
    assert any(line.startswith("done: step 6, ") for line in added)


def test_a_stopped_run_logs_its_stop_and_the_command_that_resumes_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    stopped = run_cli("train", *TINY, "max_steps=6", f"hydra.run.dir={run_dir}", cwd=tmp_path,
                      env={"LLMTRAIN_TEST_STOP_AT_STEP": "3"})
    assert stopped.returncode == EXIT_INTERRUPTED, stopped.stderr
    lines = log_lines(run_dir)
    said = [line for line in lines if line.startswith("llmtrain: stopped: ")]
    assert said == [f"llmtrain: stopped: SIGTERM (test hook) after step 3; checkpoint saved: "
                    f"{run_dir / 'checkpoints' / 'step_00000003'}"]
    assert lines[-2:] == ["To resume exactly where it stopped, run:",
                          f"  llmtrain train {' '.join(TINY)} max_steps=6 hydra.run.dir={run_dir}"]
    assert f"post-run review: not written, to stop promptly; `llmtrain report {run_dir}` writes it" in lines
    assert not (run_dir / "report.html").exists()


@pytest.fixture
def job_logs() -> Iterator[None]:
    """The job-log handlers a test adds to the root logger end with it, as with its process."""
    root = logging.getLogger()
    saved = list(root.handlers)
    yield
    for handler in [h for h in root.handlers if h not in saved]:
        root.removeHandler(handler)
        handler.close()


def test_on_a_terminal_the_log_gets_the_step_lines_not_the_bar(tmp_path: Path, job_logs: None) -> None:
    rundir.hold_job_log()
    rundir.describe_run({}, tmp_path)
    screen = io.StringIO()
    sink = Dashboard(3, LoggedConsole(file=screen, force_terminal=True, width=100))
    sink.banner("llmtrain: a run", [("steps", "3"), ("check", "all pass")])
    sink.start()
    for step in (1, 2, 3):
        sink.log_train({"step": step, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0},
                       "0:01 elapsed")
    sink.log_eval({"step": 3, "val_loss": 1.5, "val_ppl": 4.48})
    sink.stop()
    sink.print("[bold]done[/]: step 3")
    assert "\x1b[" in screen.getvalue(), "the terminal got a live bar"
    assert log_lines(tmp_path) == [
        "llmtrain: a run", "  steps    3", "  check    all pass",  # the banner as a pipe shows it, not the table
        *(f"step      {s}/3  loss 2.0000  lr 1.00e-03  gnorm 0.50  1,000 tok/s  0:01 elapsed" for s in (1, 2, 3)),
        "eval step 3: val loss 1.5000  val ppl 4.48",
        "done: step 3",
    ]


def test_a_refused_job_writes_no_log_and_each_job_of_a_sweep_its_own(tmp_path: Path, job_logs: None) -> None:
    console = LoggedConsole(file=io.StringIO())
    rundir.hold_job_log()
    console.print("preparing data for a job that is then refused")
    for job in ("0", "1"):
        rundir.hold_job_log()  # the next job: the one before is closed (or, refused, dropped)
        console.print(f"held until job {job} is accepted")
        (tmp_path / job).mkdir()
        rundir.describe_run({}, tmp_path / job)
        console.print(f"job {job}")
    assert log_lines(tmp_path / "0") == ["held until job 0 is accepted", "job 0"]
    assert log_lines(tmp_path / "1") == ["held until job 1 is accepted", "job 1"]


def test_without_a_job_log_nothing_is_kept(tmp_path: Path, job_logs: None) -> None:
    assert not rundir.job_log_kept()
    LoggedConsole(file=io.StringIO()).print("any other command, or train() called from Python")
    rundir.log_console("nowhere")
    assert not list(tmp_path.iterdir())
