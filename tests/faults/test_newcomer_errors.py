"""What a newcomer hits first: a mistyped alarm name or a value of the wrong type gets one paragraph
with the value seen and what is valid; the README's two-process command is accepted because the
micro-batch is derived from the global batch when the user does not set it; and no output cites a
document the user does not have."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmtrain.cli import COMMANDS, main
from llmtrain.cli.compose import compose_config, validate_overrides
from llmtrain.config.derived import accumulation_steps, micro_batch_size_derived
from llmtrain.config.schema import ALARM_NAMES
from llmtrain.errors import ConfigError

from ..test_cli_run import TINY, llmtrain

# A citation of a section or table of a design document ("seed 8.1", "the seed's", "(8.2)",
# "tables 5.1-5.3", "seed 003"), not the run's random seed ("seed 1337").
CITATION = re.compile(r"seed [0-9]+\.[0-9]|seed's|seed 00[0-9]|tables? [0-9]\.[0-9]|section [0-9]|SPEC [0-9]"
                      r"|\([5-9]\.[1-9][;:)]|\b[5-9]\.[1-9] (?:quantities|bands?|table|checklist|review|questions)")


def cli_error(capsys: pytest.CaptureFixture[str], *overrides: str) -> str:
    """`llmtrain train OVERRIDES --cfg job` in this process: exit 2 and the one-paragraph message."""
    with pytest.raises(SystemExit) as exited:
        main(["train", *overrides, "--cfg", "job"])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmtrain: error: "), err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# 9. unknown alarm names and wrong types: the close match, the value seen, what is valid
# ---------------------------------------------------------------------------------------------


def test_mistyped_alarm_name_gets_the_close_match_and_the_alarm_names(capsys: pytest.CaptureFixture[str]) -> None:
    message = cli_error(capsys, "monitor.actions.grad_norm_hgh=warn")
    assert "Unknown config key 'monitor.actions.grad_norm_hgh'" in message
    assert "Did you mean 'monitor.actions.grad_norm_high'?" in message
    assert all(name in message for name in ALARM_NAMES), message


def test_mistyped_alarm_name_added_with_plus_gets_the_close_match(capsys: pytest.CaptureFixture[str]) -> None:
    message = cli_error(capsys, "+monitor.actions.grad_norm_hgh=warn")
    assert "unknown alarm 'grad_norm_hgh'" in message and "Did you mean 'grad_norm_high'?" in message
    assert all(name in message for name in ALARM_NAMES), message


def test_valid_alarm_without_plus_says_to_add_the_plus(capsys: pytest.CaptureFixture[str]) -> None:
    message = cli_error(capsys, "monitor.actions.loss_spike=stop")
    assert "'+monitor.actions.loss_spike=...'" in message, message


@pytest.mark.parametrize(
    ("override", "pieces"),
    [
        pytest.param("model.n_layer=abc", ["'model.n_layer' is 'abc'", "expected an integer", "model.n_layer=4"], id="int-str"),
        pytest.param("model.n_layer=2.5", ["'model.n_layer' is 2.5", "expected an integer"], id="int-float"),
        pytest.param("max_steps=1e3", ["'max_steps' is 1000.0", "expected an integer", "max_steps=1000"], id="int-exponent"),
        pytest.param("seed=abc", ["'seed' is 'abc'", "expected an integer", "or null"], id="optional-int"),
        pytest.param("model.n_layer=null", ["'model.n_layer' is null", "expected an integer"], id="int-null"),
        pytest.param("model.dropout=high", ["'model.dropout' is 'high'", "expected a number", "model.dropout=0.0"], id="float"),
        pytest.param("model.bias=maybe", ["'model.bias' is 'maybe'", "expected a boolean: true or false"], id="bool"),
        pytest.param("model.norm=rmsnrm", ["'model.norm' is 'rmsnrm'", "valid: layernorm, rmsnorm", "Did you mean 'rmsnorm'?"],
                     id="enum-typo"),
        pytest.param("precision.name=int8", ["'precision.name' is 'int8'", "valid: fp32, bf16, fp16, auto"], id="enum"),
        pytest.param("monitor.actions.grad_norm_high=halt",
                     ["'monitor.actions.grad_norm_high' is 'halt'", "valid: warn, reduce_lr, skip_step, rollback, stop"],
                     id="enum-in-mapping"),
        pytest.param("data.seq_len_schedule=abc", ["'data.seq_len_schedule' is 'abc'", "expected a list"], id="list"),
    ],
)
def test_type_errors_name_the_value_seen_and_what_is_valid(
    capsys: pytest.CaptureFixture[str], override: str, pieces: list[str]
) -> None:
    message = cli_error(capsys, override)
    for piece in pieces:
        assert piece in message, f"{piece!r} not in {message}"
    assert "Expected type" not in message and "could not be converted" not in message, message


# ---------------------------------------------------------------------------------------------
# 10. micro_batch_size=null is derived from the global batch for the world size
# ---------------------------------------------------------------------------------------------


def test_default_run_keeps_micro_16_accumulation_1() -> None:
    cfg = compose_config([])
    assert (cfg.micro_batch_size, accumulation_steps(cfg)) == (16, 1)
    assert micro_batch_size_derived(cfg)


def test_readme_ddp_command_is_accepted_by_the_preflight_check() -> None:
    overrides = ["parallel=ddp", "parallel.nproc=2", "max_steps=30"]
    validate_overrides(overrides, preflight=True)  # refused today: 16 is not divisible by 16 x 2
    cfg = compose_config(overrides)
    assert (cfg.micro_batch_size, accumulation_steps(cfg), cfg.global_batch_size) == (8, 1, 16)


@pytest.mark.parametrize(("global_", "world", "micro", "accum"), [(64, 1, 16, 4), (48, 2, 12, 2), (30, 1, 15, 2), (8, 4, 2, 1)])
def test_derived_micro_batch_is_the_largest_divisor_up_to_16(global_: int, world: int, micro: int, accum: int) -> None:
    cfg = compose_config([f"global_batch_size={global_}", *(["parallel=ddp", f"parallel.nproc={world}"] if world > 1 else [])])
    assert (cfg.micro_batch_size, accumulation_steps(cfg)) == (micro, accum)


def test_torchrun_world_size_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = compose_config(["parallel=ddp"])
    assert (cfg.micro_batch_size, accumulation_steps(cfg)) == (4, 1)


def test_explicit_micro_batch_keeps_the_strict_check() -> None:
    with pytest.raises(ConfigError, match=r"'global_batch_size' \(16\).*\(16 x 2 = 32\)"):
        compose_config(["parallel=ddp", "parallel.nproc=2", "micro_batch_size=16"])
    cfg = compose_config(["preset=memory_saver"])  # a preset's micro-batch is explicit too
    assert (cfg.micro_batch_size, accumulation_steps(cfg), micro_batch_size_derived(cfg)) == (4, 4, False)


def test_global_batch_not_divisible_by_the_world_size_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(["parallel=ddp", "parallel.nproc=3"])
    message = str(info.value)
    assert "'global_batch_size' (16)" in message and "world size (3 processes)" in message
    assert "global_batch_size=15" in message


@pytest.mark.slow
def test_two_processes_train_with_a_derived_micro_batch(tmp_path: Path) -> None:
    tiny = [o for o in TINY if not o.startswith("micro_batch_size=")]  # global 8 over 2 ranks: 4 each
    proc = llmtrain("train", *tiny, "parallel=ddp", "parallel.nproc=2", "max_steps=2", "report=false",
                    f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "1 micro-batch of 4 per process" in proc.stdout and "derived: micro_batch_size not set" in proc.stdout
    assert (tmp_path / "run" / "model.pt").is_file()


# ---------------------------------------------------------------------------------------------
# 11. no output cites a document the user does not have
# ---------------------------------------------------------------------------------------------


def test_config_help_and_command_table_cite_no_document() -> None:
    from llmtrain.cli.train import train_help

    for text in (train_help(), *COMMANDS.values()):
        assert not CITATION.search(text), CITATION.search(text)


@pytest.mark.slow
def test_no_output_cites_a_document(tmp_path: Path) -> None:
    outputs = [llmtrain("--help", cwd=tmp_path), llmtrain("train", "--help", cwd=tmp_path)]
    outputs += [llmtrain(command, "--help", cwd=tmp_path) for command in COMMANDS if command != "train"]
    outputs.append(llmtrain("check", "--no-compute", cwd=tmp_path))
    # micro_batch_size left out: the banner says it was derived (global 8 -> 8 x 1)
    tiny = [o for o in TINY if not o.startswith("micro_batch_size=")]
    run = tmp_path / "run"
    trained = llmtrain("train", *tiny, "max_steps=4", f"hydra.run.dir={run}", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    assert "1 micro-batch of 8 per process (world size 1) (derived: micro_batch_size not set)" in trained.stdout
    outputs += [trained, llmtrain("report", str(run), cwd=tmp_path)]
    for proc in outputs:
        assert "Traceback" not in proc.stderr, proc.args
        for text in (proc.stdout, proc.stderr):
            found = CITATION.search(text)
            assert found is None, f"{proc.args[3:]} cites {found.group(0)!r}:\n{text}"
    for name in ("report.md", "report.html"):
        found = CITATION.search((run / name).read_text())
        assert found is None, f"{name} cites {found.group(0)!r}"
