"""Bad configurations through the real CLI: exit code 2 and one readable paragraph, never a traceback.

Every case runs `llmtrain ...` with its own empty working directory and data cache, so nothing is
written into the repository or the user's cache: in this process (what the CLI prints is the same,
without a new interpreter per case), and a few cases through `python -m llmtrain` in a subprocess. Most cases add
`--cfg job`: validation must refuse them before Hydra prints (or runs) anything.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import run_cli

EXIT_USER_ERROR = 2
MODEL_OPTIONS = "gpt2, gpt2_medium, gpt_small, gpt_tiny, llama_tiny, modern_tiny, smollm_135m"


def run_llmtrain(tmp_path: Path, *argv: str, timeout: float = 120,
                 in_process: bool = True) -> subprocess.CompletedProcess[str]:
    """`llmtrain ARGV` with cwd and LLMTRAIN_CACHE inside tmp_path (cwd is tmp_path/'cwd'): in this
    process (conftest.run_cli), or as `python -m llmtrain` in a subprocess for the cases that keep
    the whole interpreter in the loop (what the console script prints, with nothing imported yet)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    # the paragraph must come without Hydra's full-error mode
    changes: dict[str, str | None] = {"LLMTRAIN_CACHE": str(tmp_path / "cache"), "HYDRA_FULL_ERROR": None}
    if in_process:
        return run_cli(*argv, cwd=cwd, env=changes)
    env = {k: v for k, v in {**os.environ, **changes}.items() if v is not None}
    return subprocess.run(
        [sys.executable, "-m", "llmtrain", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_user_error(proc: subprocess.CompletedProcess[str], *expected: str) -> str:
    """Exit 2, no traceback, the message as the last stderr line, containing every `expected` piece."""
    assert proc.returncode == EXIT_USER_ERROR, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stdout, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert lines, "no message on stderr"
    message = lines[-1]
    assert message.startswith("llmtrain: error: "), proc.stderr
    for piece in expected:
        assert piece in message, f"{piece!r} not in: {message}"
    return message


# (overrides, pieces the message must contain: the key, the bad value, and what is valid)
BAD_CONFIGS = [
    pytest.param(
        ["model.n_layr=3"],
        ["'model.n_layr'", "Did you mean 'model.n_layer'?", "Valid keys under 'model':", "n_head"],
        id="unknown-key-typo",
    ),
    pytest.param(
        ["n_layer=3"],
        ["'n_layer'", "Did you mean 'model.n_layer'?", "Valid keys at the top level:", "max_steps"],
        id="unknown-top-level-key",
    ),
    pytest.param(
        ["warmup_steps=10"],
        ["'warmup_steps'", "Did you mean 'schedule.warmup_steps'?"],
        id="unknown-top-level-key-of-a-group",
    ),
    pytest.param(
        ["max_step=3"],
        ["'max_step'", "Did you mean 'max_steps'?"],
        id="unknown-top-level-key-typo",
    ),
    pytest.param(
        ["+model.foo=2"],
        ["'model.foo'", "'+key=value' cannot add keys", "Valid keys under 'model':", "n_layer"],
        id="plus-key",
    ),
    pytest.param(
        ["++model.foo=2"],
        ["'model.foo'", "'+key=value' cannot add keys"],
        id="plus-plus-key",
    ),
    pytest.param(
        ["+foo=1"],
        ["'foo'", "at the top level", "'+key=value' cannot add keys"],
        id="plus-top-level-key",
    ),
    pytest.param(
        ["model.n_layer=abc"],
        ["'model.n_layer' is 'abc'", "expected an integer", "model.n_layer=4"],
        id="wrong-type-int",
    ),
    pytest.param(
        ["optim.lr=fast"],
        ["'optim.lr' is 'fast'", "expected a number"],
        id="wrong-type-float",
    ),
    pytest.param(
        ["precision.name=fp8"],
        ["'precision.name'", "'fp8'", "fp32", "bf16", "fp16"],
        id="bad-enum",
    ),
    pytest.param(
        ["model.norm=batchnorm"],
        ["'model.norm'", "'batchnorm'", "layernorm", "rmsnorm"],
        id="bad-enum-model",
    ),
    pytest.param(
        ["data=text"],
        ["Missing required value 'data.path'", "data.path="],
        id="missing-required-value",
    ),
    pytest.param(
        ["model=foo"],
        ["'foo'", "'model'", MODEL_OPTIONS],
        id="unknown-group-option",
    ),
    pytest.param(
        ["schedule.warmup_steps=700", "max_steps=600"],
        ["schedule.warmup_steps", "700", "600 steps", "schedule.warmup_steps<600"],
        id="warmup-not-shorter-than-run",
    ),
    pytest.param(
        ["micro_batch_size=16", "global_batch_size=30"],  # an explicit micro-batch is not derived
        ["'global_batch_size' (30)", "micro_batch_size", "multiples of 16", "global_batch_size=16"],
        id="global-batch-not-divisible",
    ),
    pytest.param(
        ["data.seq_len=512"],
        ["'data.seq_len' (512)", "'model.block_size' (256)", "data.seq_len<=256"],
        id="seq-len-longer-than-context",
    ),
    pytest.param(
        ["optim.lr=0"],
        ["'optim.lr' is 0.0", "must be a finite number > 0"],
        id="lr-zero",
    ),
    pytest.param(
        ["optim.lr=-1"],
        ["'optim.lr' is -1.0", "must be a finite number > 0"],
        id="lr-negative",
    ),
    pytest.param(
        ["optim.clip_grad_value=0.5"],
        ["'optim.clip_grad_norm' (1.0)", "'optim.clip_grad_value' (0.5)", "choose one", "=null"],
        id="both-clips",
    ),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD_CONFIGS)
def test_bad_config_exits_2_with_one_paragraph(tmp_path: Path, overrides: list[str], expected: list[str]) -> None:
    proc = run_llmtrain(tmp_path, "train", *overrides, "--cfg", "job")
    check_one_paragraph(proc, tmp_path, expected)


def check_one_paragraph(proc: subprocess.CompletedProcess[str], tmp_path: Path, expected: list[str]) -> None:
    assert_user_error(proc, *expected)
    assert proc.stdout == "", "nothing may be printed (no config dump) when validation fails"
    assert len(proc.stderr.strip().splitlines()) == 1, f"expected one paragraph:\n{proc.stderr}"
    assert list((tmp_path / "cwd").iterdir()) == [], "validation must fail before Hydra writes anything"


def test_a_bad_config_through_the_console_script_is_the_same_one_paragraph(tmp_path: Path) -> None:
    """The whole interpreter in the loop once: `python -m llmtrain` prints the same paragraph."""
    overrides, expected = BAD_CONFIGS[0].values
    proc = run_llmtrain(tmp_path, "train", *overrides, "--cfg", "job", in_process=False)
    check_one_paragraph(proc, tmp_path, expected)


def test_an_option_meant_as_an_override_through_the_console_script(tmp_path: Path) -> None:
    """The whole interpreter in the loop: `--max_steps 30` is refused by Hydra's own parser, whose
    usage block and terse line become the one paragraph with the override meant."""
    proc = run_llmtrain(tmp_path, "train", "--max_steps", "30", in_process=False)
    message = assert_user_error(proc, "'--max_steps' is not an option of `llmtrain train`", "write max_steps=30.")
    assert proc.stderr.strip() == message and proc.stdout == "", proc.stderr
    assert list((tmp_path / "cwd").iterdir()) == []


def test_n_embd_not_divisible_by_n_head_suggests_a_divisor(tmp_path: Path) -> None:
    proc = run_llmtrain(tmp_path, "train", "model.n_embd=100", "model.n_head=3", "--cfg", "job")
    message = assert_user_error(proc, "'model.n_embd' (100)", "'model.n_head' (3)")
    suggestion = re.search(r"model\.n_head=(\d+)", message)
    assert suggestion, message
    assert 100 % int(suggestion.group(1)) == 0, f"suggested head count does not divide 100: {message}"


def test_good_config_still_passes(tmp_path: Path) -> None:
    """Control: the same runner with a valid config exits 0 and prints the composed job config."""
    proc = run_llmtrain(tmp_path, "train", "model=modern_tiny", "optim.lr=3e-4", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    assert "name: modern_tiny" in proc.stdout
    assert "lr: 0.0003" in proc.stdout


def _tiny_text_data(tmp_path: Path) -> list[str]:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog.\n" * 200, encoding="utf-8")
    return [
        "data=text",
        f"data.path={corpus}",
        "model.n_layer=1",
        "model.n_embd=16",
        "model.n_head=2",
        "model.block_size=16",
        "micro_batch_size=2",
        "global_batch_size=2",
        "eval_interval=0",
        "device=cpu",
        "threads=1",
    ]


@pytest.mark.parametrize(
    ("sweep", "expected"),
    [
        pytest.param(["optim.lr=1e-3,-1"], ["'optim.lr' is -1.0", "must be a finite number > 0"],
                     id="bad-value-in-second-job"),
        pytest.param(["model=gpt_tiny,foo"], ["'foo'", MODEL_OPTIONS], id="bad-group-option-in-sweep"),
        pytest.param(["model=glob(*)", "optim.lr=1e-3,-1"], ["'optim.lr' is -1.0"], id="glob-sweep-beside-a-bad-value"),
    ],
)
def test_bad_value_in_sweep_fails_before_any_job(tmp_path: Path, sweep: list[str], expected: list[str]) -> None:
    # Tiny data and model: were the pre-validation ever skipped, the first job would stay cheap.
    proc = run_llmtrain(tmp_path, "train", "-m", *sweep, "max_steps=5", *_tiny_text_data(tmp_path))
    assert_user_error(proc, *expected)
    cwd = tmp_path / "cwd"
    assert not (cwd / "multirun").exists(), "a job ran (or its sweep dir was made) before the bad value was caught"
    assert not (cwd / "outputs").exists()
    assert not (tmp_path / "cache").exists(), "data was prepared before the bad value was caught"


def test_empty_or_missing_text_file_fails_before_any_run_dir(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for path, piece in ((empty, "all empty"), (tmp_path / "absent.txt", "not a file, a folder or a glob")):
        proc = run_llmtrain(tmp_path, "train", "data=text", f"data.path={path}")
        assert_user_error(proc, "'data.path'", piece)
        assert not (tmp_path / "cwd" / "outputs").exists()


def test_unknown_command_lists_valid_commands(tmp_path: Path) -> None:
    proc = run_llmtrain(tmp_path, "bogus", in_process=False)
    assert_user_error(proc, "'bogus'", "train, prepare, check, plan, sample")


def test_data_vocab_larger_than_model_vocab_fails_before_training(tmp_path: Path) -> None:
    """Only detectable once the data is prepared: byte data has 256 tokens, the model only 100."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world, a tiny corpus for a vocabulary check.\n" * 100, encoding="utf-8")
    run_dir = tmp_path / "run"
    proc = run_llmtrain(
        tmp_path,
        "train",
        "data=text",
        f"data.path={corpus}",
        "model.vocab_size=100",
        "data.seq_len=32",
        "max_steps=2",
        f"hydra.run.dir={run_dir}",
    )
    assert_user_error(proc, "'model.vocab_size' (100)", "256", "model.vocab_size>=256", "model.vocab_size=null")
    assert not (run_dir / "model.pt").exists(), "weights were written although the config is invalid"
    assert not (run_dir / "config.yaml").exists()
    assert not (run_dir / "metrics.jsonl").exists(), "training started although the config is invalid"
