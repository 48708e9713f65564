"""The real CLI, end to end, from a temporary working directory: in this process (conftest.run_cli,
the same arguments and output as the console script), and in subprocesses where what matters is
the process itself (what `--help` imports, shell completion reading its environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from .conftest import TINY_CORPUS, run_cli

TINY = [
    "data=text", f"data.path={TINY_CORPUS}", "data.tokenizer=char",
    "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
    "micro_batch_size=4", "global_batch_size=8", "eval_interval=2", "eval_batches=2", "log_interval=1", "threads=1",
]


def llmtrain(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`llmtrain ARGS` in this process (`timeout` is kept for the callers that pass one)."""
    return run_cli(*args, cwd=cwd)


def test_help_lists_commands_without_importing_torch(tmp_path: Path) -> None:
    code = "import sys; from llmtrain.cli import main; main(['--help']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert "train" in out and "sample" in out
    assert out.strip().endswith("False"), "--help must not import torch"


def test_help_imports_only_the_standard_library(tmp_path: Path) -> None:
    """What keeps `llmtrain --help` instant: no third-party module is imported for it (torch alone
    takes ~2 s). Asserted as imports, not as a time: a busy machine makes any time limit flaky; the
    start-up time itself is measured by benchmarks/harness.py (docs/performance.md)."""
    code = ("import sys\nbefore = set(sys.modules)\nfrom llmtrain.cli import main\nmain(['--help'])\n"
            "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
            "print(sorted(new - set(sys.stdlib_module_names) - {'llmtrain'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    third_party = out.strip().splitlines()[-1]
    assert third_party == "[]", f"`llmtrain --help` imported {third_party}"


def test_train_help_shows_groups_and_options(tmp_path: Path) -> None:
    out = llmtrain("train", "--help", cwd=tmp_path).stdout
    for text in ("model", "gpt_tiny*", "gpt_small", "modern_tiny", "adamw*", "sgd", "adafactor", "cosine*", "wsd",
                 "fp16", "optim.lr"):
        assert text in out


def test_train_then_sample_from_a_temporary_cwd(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = llmtrain("train", *TINY, "max_steps=4", f"hydra.run.dir={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "unigram entropy" in proc.stdout
    for name in ("config.yaml", "metrics.jsonl", "model.pt", "tokenizer.json", ".hydra/config.yaml"):
        assert (run / name).is_file(), name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
    state = torch.load(run / "model.pt", weights_only=True)
    assert state["wte.weight"].shape[1] == 32

    endless = ("--max-new-tokens", "40", "--ignore-end-of-text")
    first = llmtrain("sample", str(run), *endless, "--seed", "3", cwd=tmp_path)
    again = llmtrain("sample", str(run), *endless, "--seed", "3", cwd=tmp_path)
    other = llmtrain("sample", str(run), *endless, "--seed", "4", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout == again.stdout, "same seed must give the same text"
    assert first.stdout != other.stdout
    assert len(first.stdout) >= 30  # 40 tokens, a character each, but end-of-text ones (which decode to nothing)
    stopping = llmtrain("sample", str(run), "--max-new-tokens", "40", "--seed", "3", cwd=tmp_path)
    assert first.stdout.startswith(stopping.stdout.rstrip("\n")), "the same tokens, up to the first end-of-text"


def test_sample_with_a_model_vocab_padded_past_the_tokenizer(tmp_path: Path) -> None:
    """gpt_small pads its vocabulary to 50304; sampling must only emit ids the tokenizer knows."""
    run = tmp_path / "run"
    proc = llmtrain("train", *TINY, "model.vocab_size=4096", "max_steps=1", f"hydra.run.dir={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for args in (["--temperature", "1.5"], ["--temperature", "0"], ["--top-k", "5"]):
        out = llmtrain("sample", str(run), "--max-new-tokens", "50", "--ignore-end-of-text", *args, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert len(out.stdout) >= 40  # one character per token, but end-of-text tokens, which decode to nothing


def test_sample_on_a_missing_run_dir_is_a_clear_error(tmp_path: Path) -> None:
    proc = llmtrain("sample", str(tmp_path / "nope"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    run = tmp_path / "no-weights"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 1\n")
    (run / "tokenizer.json").write_text('{"kind": "byte"}')
    proc = llmtrain("sample", str(run), cwd=tmp_path)
    assert proc.returncode == 2
    assert "model.pt" in proc.stderr and "checkpoint" in proc.stderr and "Traceback" not in proc.stderr


def test_multirun_writes_one_run_dir_per_job(tmp_path: Path) -> None:
    proc = llmtrain("train", "-m", *TINY, "optim.lr=1e-3,3e-4", "max_steps=2", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for job in ("0", "1"):
        cfg = (tmp_path / "sweep" / job / "config.yaml").read_text()
        assert (tmp_path / "sweep" / job / "model.pt").is_file()
        assert ("lr: 0.001" if job == "0" else "lr: 0.0003") in cfg


def test_cfg_job_prints_the_composed_config(tmp_path: Path) -> None:
    proc = llmtrain("train", "model=gpt_small", "optim=adamw", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "n_layer: 12" in proc.stdout and "n_embd: 768" in proc.stdout and "beta2: 0.95" in proc.stdout
    assert not list(tmp_path.iterdir()), "--cfg job must not write anything"


def test_shell_completion_of_commands_and_overrides(tmp_path: Path) -> None:
    def complete(line: str) -> str:
        env = {**os.environ, "COMP_LINE": line, "COMP_POINT": str(len(line))}
        return subprocess.run(
            [sys.executable, "-m", "llmtrain", "-sc", "query=bash"],
            cwd=tmp_path, env=env, capture_output=True, text=True,
        ).stdout

    assert complete("llmtrain tr").split() == ["train"]
    assert set(complete("llmtrain train model=gpt_").split()) == {"model=gpt_small", "model=gpt_tiny"}
    for args in (["train", "-sc", "install=bash"], ["-sc", "install=bash"]):
        proc = llmtrain(*args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "complete -o nospace" in proc.stdout and proc.stdout.rstrip().endswith("llmtrain")


def test_default_stdlib_data_trains(tmp_path: Path) -> None:
    """The embedded default (stdlib sources, byte tokens) with a tiny model and 3 steps."""
    run = tmp_path / "run"
    proc = llmtrain(
        "train", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=64", "micro_batch_size=2",
        "global_batch_size=2", "max_steps=3", "eval_interval=3", "eval_batches=1", f"hydra.run.dir={run}", cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    # The whole default corpus (other tests of the session may cache a data.max_bytes cut of it).
    meta_files = [path for path in Path(os.environ["LLMTRAIN_CACHE"]).glob("data/python_stdlib-byte-*/meta.json")
                  if json.loads(path.read_text())["source_bytes"] > 1_000_000]
    assert len(meta_files) == 1
    meta = json.loads(meta_files[0].read_text())
    assert meta["vocab_size"] == 256 and meta["train_tokens"] > 1_000_000 and meta["val_tokens"] > 10_000
    assert 2.0 < meta["unigram_entropy_nats"] < 5.5
    assert f"{meta['unigram_entropy_nats']:.4f}" in proc.stdout
