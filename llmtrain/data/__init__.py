"""Data: corpora, tokenizers, preparation into memory-mapped token files, and batch samplers.

The names below are imported on first use: the CLI's pre-validation imports `corpus` only, and
must not pay for numpy and torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PreparedData": "cache", "prepare_data": "prepare", "RandomWindowSampler": "sampler", "EpochSampler": "sampler",
    "InstructionSampler": "sampler",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"llmtrain.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'llmtrain.data' has no attribute {name!r}")
