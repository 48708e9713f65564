"""report.console (issue 20, point 7): what `train` prints of the post-run review. short: a line per
verdict that is not ok and the report's path; full: the table; auto: short for a run under 5
minutes. `report=false`, the spelling from before report had its own keys, still works on the
command line, in Python and in an old run dir's config.yaml."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from llmtrain.checkpoint.resume import config_changes
from llmtrain.cli.compose import compose_config, upgrade_overrides
from llmtrain.config.hydra import config_from_dict
from llmtrain.config.schema import Config, ReportConfig, ReportConsole, config_to_dict
from llmtrain.core.errors import ConfigError
from llmtrain.core.findings import Finding, Status
from llmtrain.runs.report.render import console_mode, render_console
from llmtrain.runs.report.verdict import FAIL, NA, OK, WARN, Report, Verdict

from .conftest import TINY_CORPUS, run_cli

QUESTIONS = [("learning", "Did the model learn?"), ("smoothness", "Is the loss curve smooth?"),
             ("overfitting", "Does validation track training?"), ("inference", "Does inference behave like training?"),
             ("memory", "Peak memory and headroom?"), ("step_time", "Where does a step's time go?"),
             ("alarms", "Which alarms were raised, and what was done?")]
TINY = ["data=text", f"data.path={TINY_CORPUS}", "data.tokenizer=char", "model.n_layer=1", "model.n_embd=32",
        "model.n_head=2", "model.block_size=32", "micro_batch_size=4", "global_batch_size=8", "max_steps=2",
        "eval_interval=0", "threads=1", "checkpoint=none"]


def report(statuses: dict[str, Status] | None = None, seconds: float | None = 12.0) -> Report:
    """A report whose verdicts are ok except `statuses` (key -> status), its finding 'finding of KEY'."""
    statuses = statuses or {}
    verdicts = [Verdict(key, Finding(question, statuses.get(key, OK), f"finding of {key}"))
                for key, question in QUESTIONS]
    verdicts.append(Verdict("curves", Finding("The health quantities over the run", WARN, "the monitor's own verdict")))
    run = Path("/runs/r1")
    return Report(run, "Run report: r1", [], verdicts, {}, markdown=run / "report.md", html=run / "report.html",
                  seconds=seconds)


def printed(rep: Report, setting: str) -> str:
    console = Console(file=io.StringIO(), width=120)
    render_console(rep, console, setting)
    return console.file.getvalue()


def test_short_prints_one_line_per_verdict_that_is_not_ok_and_the_path() -> None:
    out = printed(report({"smoothness": WARN, "memory": FAIL, "step_time": NA, "learning": NA}), "short")
    assert out.splitlines() == [
        "post-run review: 1 fail, 1 warn, 3 ok, 2 n/a (learning, step time); report: /runs/r1/report.html",
        "  warn Is the loss curve smooth? finding of smoothness",
        "  fail Peak memory and headroom? finding of memory",
    ]


def test_short_is_one_line_when_every_question_is_ok() -> None:
    assert printed(report(), "short") == "post-run review: all 7 questions ok; report: /runs/r1/report.html\n"


def test_full_prints_the_table_and_auto_picks_by_the_runs_wall_time() -> None:
    full = printed(report({"smoothness": WARN}), "full")
    assert "post-run review: /runs/r1" in full and all(question in full for _, question in QUESTIONS)
    assert "finding of learning" in full and "report: /runs/r1/report.html (plots inside), /runs/r1/report.md" in full
    assert console_mode(report(seconds=299.0), "auto") == "short"
    assert console_mode(report(seconds=300.0), "auto") == "full"
    assert console_mode(report(seconds=None), "auto") == "short"  # no train record: no run worth a table
    assert console_mode(report(seconds=1000.0), "short") == "short"
    assert console_mode(report(seconds=1.0), "full") == "full"
    assert printed(report(seconds=20.0), "auto") == printed(report(), "short")


def test_the_old_spelling_is_rewritten_before_hydra_sees_it() -> None:
    assert upgrade_overrides(["-m", "report=false", "report=true,false", "report.console=full", "max_steps=3",
                              "hydra.run.dir=x/report=1"]) == [
        "-m", "report.enabled=false", "report.enabled=true,false", "report.console=full", "max_steps=3",
        "hydra.run.dir=x/report=1"]
    assert compose_config(["report=false"]).report == ReportConfig(enabled=False)
    cfg = compose_config(["report.console=short"])
    assert cfg.report.enabled and cfg.report.console is ReportConsole.short
    with pytest.raises(ConfigError, match=r"'report.console' is 'brief'; valid: auto, short, full"):
        compose_config(["report.console=brief"])


def test_an_old_config_with_a_boolean_report_loads_and_resumes() -> None:
    saved = config_to_dict(Config())
    for old in (True, False):
        saved["report"] = old
        assert config_from_dict(saved).report == ReportConfig(enabled=old)
    saved["report"], saved["threads"] = True, None  # and threads: null, what auto was called before
    assert config_changes(saved, config_to_dict(Config())) == [], "no change a resume reports or refuses"
    assert Config(report=False).report == ReportConfig(enabled=False)  # Python callers' old spelling


def test_a_yaml_file_with_the_old_boolean_report_gets_one_paragraph(tmp_path: Path) -> None:
    (tmp_path / "preset").mkdir()
    (tmp_path / "preset" / "noreport.yaml").write_text("# @package _global_\nreport: false\n")
    done = run_cli("train", "-cd", str(tmp_path), "preset=noreport", "max_steps=2", cwd=tmp_path)
    assert done.returncode == 2
    assert "'report' is a section of its own now" in done.stderr and "report: {enabled: false}" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_a_run_with_report_false_writes_no_report_and_a_short_run_prints_the_short_review(tmp_path: Path) -> None:
    quiet = run_cli("train", *TINY, "report=false", f"hydra.run.dir={tmp_path / 'quiet'}", cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert (tmp_path / "quiet" / "metrics.jsonl").is_file() and not (tmp_path / "quiet" / "report.md").exists()
    assert "post-run review" not in quiet.stdout
    assert "enabled: false" in (tmp_path / "quiet" / "config.yaml").read_text()

    short = run_cli("train", *TINY, f"hydra.run.dir={tmp_path / 'short'}", cwd=tmp_path)
    assert short.returncode == 0, short.stderr
    review = [line for line in short.stdout.splitlines() if line.startswith("post-run review: ")]
    assert len(review) == 1 and review[0].endswith(f"report: {tmp_path / 'short' / 'report.html'}"), short.stdout
    assert "┏" not in short.stdout and (tmp_path / "short" / "report.md").is_file()
