"""data.seq_len_schedule: short sequences early (seed 003 2.2), tokens per step or batch kept, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtrain.config.derived import seq_len_of, seq_len_stages
from llmtrain.config.schema import Sampling, SeqLenKeep
from llmtrain.config.validate import validate
from llmtrain.core.errors import ConfigError, Interrupted
from llmtrain.training.loop import train

from .conftest import tiny_config

SCHEDULE = [[0, 8], [3, 16], [6, 32]]


def records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_the_cli_form_composes_and_gives_the_stages() -> None:
    from llmtrain.cli.compose import compose_config

    cfg = compose_config(["data.seq_len_schedule=[[0,256],[1000,512],[3000,1024]]", "model.block_size=1024",
                          "micro_batch_size=8", "global_batch_size=32", "max_steps=5000"])
    assert seq_len_of(cfg) == 1024
    assert [(s.start_step, s.seq_len, s.micro_batch_size) for s in seq_len_stages(cfg)] == [
        (0, 256, 32), (1000, 512, 16), (3000, 1024, 8)]  # 8 x 1024 tokens per micro-batch throughout


def test_keeping_tokens_draws_more_short_sequences_and_every_step_has_the_same_tokens(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, max_steps=8, **{"data.seq_len_schedule": SCHEDULE}))
    steps = records(run, "train")
    assert [r["seq_len"] for r in steps] == [8, 8, 8, 16, 16, 16, 32, 32]
    assert [r["tokens"] for r in steps] == [256 * (i + 1) for i in range(8)]  # 8 x 32 tokens per step throughout
    assert [(r["step"], r["seq_len"], r["micro_batch_size"]) for r in records(run, "seq_len")] == [
        (0, 8, 16), (3, 16, 8), (6, 32, 4)]


def test_keeping_the_batch_gives_fewer_tokens_per_step_early(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, max_steps=8, **{"data.seq_len_schedule": SCHEDULE, "data.seq_len_keep": SeqLenKeep.batch}))
    tokens = [0] + [r["tokens"] for r in records(run, "train")]
    assert [b - a for a, b in zip(tokens, tokens[1:])] == [64] * 3 + [128] * 3 + [256] * 2  # 8 sequences per step


def test_a_run_stopped_inside_a_stage_resumes_with_the_same_batches(tmp_path: Path, monkeypatch) -> None:
    settings = {"max_steps": 9, "data.seq_len_schedule": SCHEDULE}
    reference = train(tiny_config(tmp_path / "ref", **settings))
    run = tmp_path / "run"
    monkeypatch.setenv("LLMTRAIN_TEST_STOP_AT_STEP", "4")
    with pytest.raises(Interrupted):
        train(tiny_config(run, **settings))
    monkeypatch.delenv("LLMTRAIN_TEST_STOP_AT_STEP")
    resumed = train(tiny_config(run, **settings))
    assert all(resumed.train_losses[s] == reference.train_losses[s] for s in range(5, 10))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"data.seq_len_schedule": [[2, 8], [5, 32]]}, "must say the length at step 0"),
        ({"data.seq_len_schedule": [[0, 8], [5, 64]]}, r"every length must be in 1..model.block_size \(32\), not 64"),
        ({"data.seq_len_schedule": [[0, 12], [5, 32]]}, r"length\(s\) \[12\] do not divide"),
        ({"data.seq_len_schedule": [[0, 8], [50, 32]]}, "the stage at step 50 never starts"),
        ({"data.seq_len_schedule": [[0, 8, 1]]}, r"give \[step, seq_len\] pairs"),
        ({"data.seq_len_schedule": [[0, 8], [0, 16], [5, 32]]}, "each step may start one stage only"),
        ({"data.seq_len_schedule": [[0, 8], [5, 32]], "data.seq_len": 16}, "drop data.seq_len"),
        ({"data.seq_len_schedule": [[0, 8], [5, 32]], "data.sampling": Sampling.epoch}, "needs data.sampling=random"),
    ],
)
def test_bad_schedules_are_refused_with_the_fix(tmp_path: Path, overrides: dict, message: str) -> None:
    cfg = tiny_config(tmp_path / "run", **overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_uneven_lengths_are_fine_when_the_batch_is_kept(tmp_path: Path) -> None:
    validate(tiny_config(tmp_path / "run", **{"data.seq_len_schedule": [[0, 12], [5, 32]],
                                              "data.seq_len_keep": SeqLenKeep.batch}))
