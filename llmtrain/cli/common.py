"""What every command module shares: the error exit (`fail`), the shipped config folder, a value
read off the command line, and the subnormal switch that must come before any compute.

Only the standard library and `llmtrain.errors` at module level, like every module of the CLI:
torch is imported inside the one function that needs it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

from llmtrain.errors import EXIT_USER_ERROR


def fail(message: str, code: int = EXIT_USER_ERROR, label: str = "error") -> NoReturn:
    """Print `llmtrain: <label>: <message>` (one paragraph, no traceback) and exit with `code`."""
    sys.stderr.write(f"llmtrain: {label}: {message}\n")
    sys.exit(code)


def conf_dir() -> Path:
    """The shipped config groups: inside the installed package, or `conf/` of a source checkout."""
    package = Path(__file__).resolve().parents[1]  # llmtrain/
    candidates = (package / "conf", package.parent / "conf")
    for candidate in candidates:
        if (candidate / "config.yaml").is_file():
            return candidate
    raise RuntimeError(f"llmtrain's config folder is missing (looked in {candidates[0]} and {candidates[1]})")


def check_config_dir(config_dir: str | None) -> None:
    """`--config-dir`/`-cd`, when given, must be a folder: refused in one line before any work."""
    if config_dir and not Path(config_dir).expanduser().is_dir():
        fail(f"--config-dir is '{config_dir}', which is not a folder; give a folder of group options like conf/.")


def given(overrides: list[str], key: str) -> str | None:
    """The value the command line gives `key` (as key=, +key= or ++key=; the last one wins), or None."""
    values = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith(f"{key}=")]
    return values[-1] if values else None


def flush_denormals_first(overrides: list[str]) -> None:
    """Flush subnormal floats to zero before this process computes anything (flush_denormal=false on
    the command line keeps them). Subnormals make CPU kernels many times slower (a 1024^2 matmul 60x,
    fused AdamW 20x here), and the switch is per thread: torch's thread pools take it from the thread
    that starts them, so setting it later, in train(), reaches the main thread only."""
    import torch

    value = given(overrides, "flush_denormal")
    torch.set_flush_denormal(value is None or value.strip().lower() not in ("false", "0", "no", "off"))
