"""Shared fixtures: a tiny fp32 config on a small shipped corpus, trained in a few seconds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmtrain.config.schema import (
    Config,
    DataConfig,
    DataSource,
    ModelConfig,
    OptimConfig,
    ScheduleConfig,
    TokenizerKind,
)

ASSETS = Path(__file__).parent / "assets"
TINY_CORPUS = ASSETS / "tiny_corpus.txt"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prepared data goes to a per-session temp cache, never into the user's ~/.cache."""
    monkeypatch.setenv("LLMTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def tiny_config(out_dir: Path, **overrides: object) -> Config:
    """2 layers x 32 wide, context 32, char tokens of the shipped corpus; fp32 on CPU."""
    cfg = Config(
        model=ModelConfig(name="test_tiny", n_layer=2, n_head=2, n_embd=32, block_size=32),
        optim=OptimConfig(lr=3e-3),
        schedule=ScheduleConfig(warmup_steps=2),
        data=DataConfig(
            source=DataSource.text,
            path=str(TINY_CORPUS),
            tokenizer=TokenizerKind.char,
            val_fraction=0.1,
            cache_dir=os.environ.get("LLMTRAIN_CACHE"),
        ),
        seed=1234,
        max_steps=10,
        micro_batch_size=4,
        global_batch_size=8,
        eval_interval=0,
        log_interval=1,
        out_dir=str(out_dir),
        device="cpu",
        threads=1,
    )
    for key, value in overrides.items():
        target = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            target = getattr(target, part)
        setattr(target, leaf, value)
    return cfg
