"""Where llmtrain keeps what outlives a run: $LLMTRAIN_CACHE, else ~/.cache/llmtrain. Prepared data
goes under it (unless data.cache_dir says otherwise), and so do compile=auto's measurements and
Inductor's compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    env = os.environ.get("LLMTRAIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llmtrain"
