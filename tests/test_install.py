"""A normal (non-editable) install ships conf/ inside the package and runs from any directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # pip installs into a folder
def test_non_editable_install_runs_from_any_directory(tmp_path: Path) -> None:
    # Build from a copy: an in-tree build would leave build/ and *.egg-info in the repository.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("llmtrain", "conf"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    assert (target / "llmtrain" / "conf" / "config.yaml").is_file()
    assert (target / "llmtrain" / "conf" / "model" / "gpt_tiny.yaml").is_file()
    assert (target / "llmtrain" / "conf" / "hydra" / "launcher" / "slurm.yaml").is_file()  # two levels down
    # every subpackage is listed in pyproject.toml (a package left out imports from a checkout only)
    shipped = {p.relative_to(target).as_posix() for p in (target / "llmtrain").rglob("*.py")}
    in_tree = {p.relative_to(ROOT).as_posix() for p in (ROOT / "llmtrain").rglob("*.py")}
    assert in_tree <= shipped, sorted(in_tree - shipped)
    code = (
        f"import sys; sys.path.insert(0, {str(target)!r}); import llmtrain.cli as c; "
        "print(c.__file__); c.main(['train', 'model=gpt_small', '--cfg', 'job'])"
    )
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first_line, config = proc.stdout.split("\n", 1)
    assert first_line.startswith(str(target)), f"imported {first_line}, not the installed copy"
    assert "n_layer: 12" in config
