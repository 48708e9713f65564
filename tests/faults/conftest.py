"""What the fault suite's tests share: a finished run to damage (each test works on a copy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..conftest import run_cli
from ..test_cli_run import TINY


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("trained")
    proc = run_cli("train", *TINY, "max_steps=4", "checkpoint.every_steps=2", "report=false",
                   f"hydra.run.dir={tmp / 'run'}", cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in (tmp / "run" / "checkpoints").iterdir()} >= {"step_00000002", "step_00000004", "latest"}
    return tmp / "run"
