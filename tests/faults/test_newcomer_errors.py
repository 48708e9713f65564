"""What a newcomer hits first: a mistyped alarm name or a value of the wrong type gets one paragraph
with the value seen and what is valid; the README's two-process command is accepted because the
micro-batch is derived from the global batch when the user does not set it; no output cites a
document the user does not have; and a command line written the way other tools take it
(`--max_steps 30`, `max_steps 30`, a comma list without -m, a mistyped option) is one paragraph
that shows the override meant."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmtrain import __version__
from llmtrain.cli import COMMANDS, main
from llmtrain.cli.compose import compose_config, validate_overrides
from llmtrain.config.derived import accumulation_steps, micro_batch_size_derived
from llmtrain.config.schema import ALARM_NAMES
from llmtrain.core.errors import ConfigError

from ..conftest import run_cli
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
        pytest.param("model.n_layer=abc", ["'model.n_layer' is 'abc'", "expected an integer", "model.n_layer=4"],
                     id="int-str"),
        pytest.param("model.n_layer=2.5", ["'model.n_layer' is 2.5", "expected an integer"], id="int-float"),
        pytest.param("max_steps=1e3", ["'max_steps' is 1000.0", "expected an integer", "max_steps=1000"],
                     id="int-exponent"),
        pytest.param("seed=abc", ["'seed' is 'abc'", "expected an integer", "or null"], id="optional-int"),
        pytest.param("model.n_layer=null", ["'model.n_layer' is null", "expected an integer"], id="int-null"),
        pytest.param("model.dropout=high", ["'model.dropout' is 'high'", "expected a number", "model.dropout=0.0"],
                     id="float"),
        pytest.param("model.bias=maybe", ["'model.bias' is 'maybe'", "expected a boolean: true or false"], id="bool"),
        pytest.param("model.norm=rmsnrm",
                     ["'model.norm' is 'rmsnrm'", "valid: layernorm, rmsnorm", "Did you mean 'rmsnorm'?"],
                     id="enum-typo"),
        pytest.param("precision.name=int8", ["'precision.name' is 'int8'", "valid: fp32, bf16, fp16, auto"], id="enum"),
        pytest.param("monitor.actions.grad_norm_high=halt",
                     ["'monitor.actions.grad_norm_high' is 'halt'",
                      "valid: warn, reduce_lr, skip_step, rollback, stop"],
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


@pytest.mark.parametrize(("global_", "world", "micro", "accum"),
                         [(64, 1, 16, 4), (48, 2, 12, 2), (30, 1, 15, 2), (8, 4, 2, 1)])
def test_derived_micro_batch_is_the_largest_divisor_up_to_16(global_: int, world: int, micro: int, accum: int) -> None:
    cfg = compose_config([f"global_batch_size={global_}",
                          *(["parallel=ddp", f"parallel.nproc={world}"] if world > 1 else [])])
    assert (cfg.micro_batch_size, accumulation_steps(cfg)) == (micro, accum)


def test_torchrun_world_size_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = compose_config(["parallel=ddp"])
    assert (cfg.micro_batch_size, accumulation_steps(cfg)) == (4, 1)


def test_explicit_micro_batch_keeps_the_strict_check() -> None:
    with pytest.raises(ConfigError, match=r"'global_batch_size' \(16\).*\(16 x 2 = 32\)"):
        compose_config(["parallel=ddp", "parallel.nproc=2", "micro_batch_size=16"])
    cfg = compose_config(["micro_batch_size=4"])
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


# ---------------------------------------------------------------------------------------------
# 12. the command line: a config value typed as an option, an override without '=', a sweep
#     without -m, a mistyped group option, --version after a command
# ---------------------------------------------------------------------------------------------


def refused(tmp_path: Path, *argv: str) -> str:
    """`llmtrain ARGV` in this process: exit 2, one line on stderr (no usage block, no traceback),
    nothing on stdout and nothing written; returns the line."""
    proc = run_cli(*argv, cwd=tmp_path)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmtrain: error: "), proc.stderr
    assert "usage:" not in proc.stderr and "Traceback" not in proc.stderr and proc.stdout == ""
    assert list(tmp_path.iterdir()) == [], "refused before anything is written"
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "fix"),
    [
        pytest.param(["train", "--max_steps", "30"], "write max_steps=30.", id="dashes"),
        pytest.param(["train", "--max_steps=30"], "write max_steps=30.", id="dashes-equals"),
        pytest.param(["train", "-max_steps=30"], "write max_steps=30.", id="one-dash"),  # argparse read it as -m
        pytest.param(["train", "--max_step", "30"], "write max_steps=30 ('max_step' is no config key",
                     id="dashes-typo"),
        pytest.param(["train", "--lr", "1e-3"], "write optim.lr=1e-3 ('lr' is no config key", id="dashes-group-key"),
        pytest.param(["train", "--max_steps", "model=gpt2"], "write max_steps=<value>.", id="dashes-no-value"),
        pytest.param(["check", "--max_steps", "30"], "write max_steps=30.", id="check"),
        pytest.param(["prepare", "--data.path=corpus.txt"], "write data.path=corpus.txt.", id="prepare"),
        pytest.param(["doctor", "overfit", "--lr", "1e-3"], "write optim.lr=1e-3", id="doctor"),
        pytest.param(["eval", "run", "--max_steps", "3"], "write max_steps=3.", id="eval"),
    ],
)
def test_a_config_value_typed_as_an_option_gets_the_override(tmp_path: Path, argv: list[str], fix: str) -> None:
    message = refused(tmp_path, *argv)
    word = next(arg for arg in argv if arg.startswith("-"))
    assert f"'{word}' is not an option of `llmtrain {argv[0]}`" in message and "key=value" in message, message
    assert fix in message, message


@pytest.mark.parametrize(
    ("argv", "pieces"),
    [
        pytest.param(["train", "--multi-run"], ["Did you mean --multirun?"], id="mistyped-option"),
        pytest.param(["train", "--verbose"], ["its options are", "-m", "--cfg", "--config-dir/-cd", "max_steps=30"],
                     id="unknown-option"),
        pytest.param(["train", "--cfg", "yaml"], ["invalid choice: 'yaml'", "'job'"], id="bad-choice"),
        pytest.param(["check", "-m", "optim.lr=1,2"], ["`llmtrain train -m ...`"], id="sweep-flag-elsewhere"),
    ],
)
def test_a_mistyped_option_is_one_paragraph(tmp_path: Path, argv: list[str], pieces: list[str]) -> None:
    message = refused(tmp_path, *argv)
    for piece in pieces:
        assert piece in message, message


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--cfg", "job", "--resolve", "max_steps=30"], id="cfg-resolve"),
        pytest.param(["-c", "job", "-p", "model", "max_steps=30"], id="package"),
        pytest.param(["--cfg=job", "--config-name", "config"], id="config-name"),
        pytest.param(["-cn", "config", "--cfg", "job", "-cd", "."], id="config-dir"),
        pytest.param(["--cf", "job"], id="abbreviation"),
        pytest.param(["--info", "defaults"], id="info"),
        pytest.param(["--hydra-help"], id="hydra-help"),
        pytest.param(["--help"], id="help"),
    ],
)
def test_hydras_own_options_still_work(tmp_path: Path, flags: list[str]) -> None:
    proc = run_cli("train", *flags, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout and "llmtrain: error" not in proc.stderr


@pytest.mark.parametrize(
    ("overrides", "pieces"),
    [
        pytest.param(["max_steps", "30"], ["'max_steps' is not an override", "key=value", "write max_steps=30."],
                     id="space"),
        pytest.param(["max_steps", "=", "30"], ["write max_steps=30."], id="spaces-around"),
        pytest.param(["max_steps=", "30"], ["'max_steps= 30' has a space after '='", "write max_steps=30."],
                     id="space-after"),
        pytest.param(["max_step", "30"], ["write max_steps=30 ('max_step' is no config key"], id="space-typo"),
        pytest.param(["+model.n_layr", "3"], ["write model.n_layer=3"], id="space-plus-typo"),
        pytest.param(["gpt_small"], ["Did you mean model=gpt_small?"], id="option-alone"),
        pytest.param(["max_steps=30,"], ["'max_steps=30,' ends with a comma", "write max_steps=30.", "-m"],
                     id="trailing-comma"),
        pytest.param(["optim.lr=1e-3,,3e-3"], ["empty item", "`llmtrain train -m optim.lr=1e-3,3e-3`"],
                     id="double-comma"),
        pytest.param(["+model.n_layr=3"], ["'model.n_layr'", "Did you mean 'model.n_layer'?"], id="plus-typo"),
        pytest.param(["modle=gpt2"], ["'modle'", "Did you mean 'model'?"], id="group-name-typo"),
    ],
)
def test_an_override_hydra_cannot_read_gets_the_one_meant(
    tmp_path: Path, overrides: list[str], pieces: list[str]
) -> None:
    message = refused(tmp_path, "train", *overrides)
    for piece in pieces:
        assert piece in message, message
    assert "hydra.cc" not in message and "EOF" not in message, message


@pytest.mark.parametrize("command", ["train", "check"])
def test_a_comma_list_without_m_is_a_sweep_that_needs_m(tmp_path: Path, command: str) -> None:
    message = refused(tmp_path, command, "optim.lr=1e-3,3e-3")
    assert "'optim.lr=1e-3,3e-3' is a sweep" in message and "one job per value" in message, message
    assert "`llmtrain train -m optim.lr=1e-3,3e-3`" in message and "give one value, e.g. optim.lr=1e-3" in message
    # a learning rate is no list, and no string: the bracket and quoting advice is for keys that take one
    assert "[" not in message and "Ambiguous" not in message and "quote" not in message, message


@pytest.mark.parametrize(
    ("override", "as_list"),
    [
        pytest.param("preset=stable,fast", "'preset=[stable,fast]'", id="group-of-lists"),
        pytest.param("data.seq_len_schedule=[0,16],[100,32]", "'data.seq_len_schedule=[[0,16],[100,32]]'",
                     id="list-key"),
    ],
)
def test_a_comma_list_for_a_key_that_takes_a_list_also_says_how_to_set_the_list(
    tmp_path: Path, override: str, as_list: str
) -> None:
    message = refused(tmp_path, "train", override)
    assert "is a sweep" in message and f"`llmtrain train -m {override}`" in message and as_list in message, message


def test_a_sweep_function_without_m_needs_m(tmp_path: Path) -> None:
    message = refused(tmp_path, "train", "max_steps=range(10,30,10)")
    assert "is a sweep (range())" in message and "`llmtrain train -m max_steps=range(10,30,10)`" in message, message


@pytest.mark.parametrize(
    ("override", "meant"),
    [("model=gpt_smal", "model=gpt_small"), ("preset=stabel", "preset=stable"), ("optim=sdg", "optim=sgd")],
)
def test_a_mistyped_group_option_gets_the_close_match(tmp_path: Path, override: str, meant: str) -> None:
    message = refused(tmp_path, "train", override)
    assert f"Did you mean {meant}?" in message and "Valid options:" in message, message
    assert "(e.g." not in message, "the close match, not the first option, is the example"


def test_the_same_comma_list_with_m_is_a_sweep() -> None:
    """Control: with -m the comma list is expanded and every job validated, nothing refused."""
    validate_overrides(["optim.lr=1e-3,3e-3", "max_steps=30"], multirun=True)


@pytest.mark.parametrize("argv", [["--version"], ["train", "--version"], ["check", "--version"]])
def test_version_is_llmtrains_own_after_any_command(tmp_path: Path, argv: list[str]) -> None:
    proc = run_cli(*argv, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"llmtrain {__version__} (torch ") and "Hydra" in proc.stdout, proc.stdout
    assert len(proc.stdout.strip().splitlines()) == 1


def test_a_missing_plugin_names_the_extra_that_installs_it() -> None:
    """hydra/sweeper=lr_search without the optuna extra: Hydra says only that it could not load a
    config; the paragraph names the extra. (Simulated: this environment has every extra.)"""
    from hydra.errors import MissingConfigException

    from llmtrain.cli import compose

    error = MissingConfigException("In 'hydra/sweeper/lr_search': Could not load 'hydra/sweeper/optuna'.",
                                   missing_cfg_file="hydra/sweeper/optuna")
    message = str(compose._composition_error(error))
    assert "Hydra's Optuna sweeper plugin" in message and "pip install 'llmtrain[optuna]'" in message
