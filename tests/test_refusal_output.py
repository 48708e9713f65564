"""A refused start prints the FAIL rows only, how many rows it left out, and the `llmtrain check`
command that prints the whole table; `llmtrain check` itself still prints every row."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from llmtrain.cli import main
from llmtrain.cli.common import conf_dir
from llmtrain.cli.compose import validate_overrides
from llmtrain.preflight.check import CheckFailed
from llmtrain.preflight.render import check_command_line

from .conftest import TINY_CORPUS, tiny_config

# fp16 without loss scaling FAILs the mixed-precision row; the default gradient clipping PASSes.
FAILING = ["precision=fp16", "precision.loss_scaling=false", "max_steps=2"]
TINY = ["data=text", f"data.path={TINY_CORPUS}", "data.tokenizer=char", "model.n_layer=1", "model.n_embd=32",
        "model.n_head=2", "model.block_size=32", "global_batch_size=4"]


def full_table_command(err: str) -> list[str]:
    lines = err.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("the full table"))
    return shlex.split(lines[at + 1])


def test_a_refused_start_prints_only_the_failing_rows(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CheckFailed) as refused:
        validate_overrides([*TINY, *FAILING, "hydra.run.dir=runs/x"], preflight=True)
    err = capsys.readouterr().err
    report = refused.value.report
    assert [r.item for r in report.failures] == ["mixed precision"]
    assert "FAIL mixed precision: fp16 on cpu, NO loss scaling" in err
    assert "fix: precision.loss_scaling=true" in err and "why: fp16 has 5 exponent bits" in err
    warned, passed = len(report.warnings), len(report.rows) - 1 - len(report.warnings)
    assert f"FAIL on 1 of {len(report.rows)} items ({warned} warn, {passed} pass not shown)" in err
    for row in report.rows:
        if row.item != "mixed precision":
            assert f"{row.item}:" not in err and row.seen not in err, \
                f"the {row.status.value} row '{row.item}' is printed"
    assert "┃" not in err and "predicted peak" not in err  # no table, no estimate
    assert full_table_command(err) == ["llmtrain", "check", *TINY, *FAILING]  # the run dir is check's no concern


def test_the_printed_command_prints_the_full_table(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CheckFailed):
        validate_overrides([*TINY, *FAILING], preflight=True)
    command = full_table_command(capsys.readouterr().err)
    with pytest.raises(SystemExit) as stop:
        main([*command[1:], "--no-compute"])  # the command as printed (no matmul timing: quicker)
    out = capsys.readouterr().out
    assert stop.value.code == 2
    assert "gradient clipping" in out and "PASS" in out and "mixed precision" in out  # every row
    assert "predicted peak" in out and out.strip().endswith("-> exit 2")


def test_a_refusal_by_train_itself_prints_the_failing_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """train() checks again once the data is prepared; a config built in code has no command line,
    so the command is named without overrides."""
    from llmtrain.config.schema import Precision
    from llmtrain.training.loop import train

    cfg = tiny_config(tmp_path / "run", **{"precision.name": Precision.fp16, "precision.loss_scaling": False})
    with pytest.raises(CheckFailed):
        train(cfg)
    out = capsys.readouterr().out
    assert "FAIL mixed precision" in out and "precision.loss_scaling=true" in out
    assert "gradient clipping" not in out and "┃" not in out
    assert "llmtrain check  (with the overrides that make this config)" in out


def test_the_command_of_a_hydra_run_keeps_its_overrides_and_config_dir(tmp_path: Path) -> None:
    """Inside a Hydra job the overrides come from Hydra's record of it (HydraConfig)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from llmtrain.config.hydra import command_line_of_this_run, register_configs

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("name: mine\nn_layer: 1\n")
    register_configs()
    GlobalHydra.instance().clear()
    previous = HydraConfig.instance().cfg
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="train"):
            node = compose(config_name="config", return_hydra_config=True, overrides=[
                f"hydra.searchpath=[file://{tmp_path}]", "model=mine", "optim.lr=3e-4", "out_dir=runs/a b"])
        HydraConfig.instance().set_config(node)
        overrides, config_dir = command_line_of_this_run()
    finally:
        HydraConfig.instance().cfg = previous
        GlobalHydra.instance().clear()
    assert config_dir == str(tmp_path)
    assert check_command_line(overrides, config_dir) == f"llmtrain check -cd {tmp_path} model=mine optim.lr=3e-4"


def test_check_command_line_quotes_and_drops_the_run_dir() -> None:
    line = check_command_line(["hydra.run.dir=out/x", "+hydra.job.name=y", "out_dir=z", "data.path=my corpus.txt",
                               "data.seq_len_schedule=[[0,16],[5,32]]"], "my conf")
    assert shlex.split(line) == ["llmtrain", "check", "-cd", "my conf", "data.path=my corpus.txt",
                                 "data.seq_len_schedule=[[0,16],[5,32]]"]
    assert check_command_line([]) == "llmtrain check"
