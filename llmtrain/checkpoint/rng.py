"""The random generators' states in a checkpoint: torch's (rng.pt) and Python's and NumPy's
(trainer_state.json), taken at a save and put back on a resume or a rollback, so the run goes on
drawing the numbers the uninterrupted one would."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_snapshot() -> tuple[dict, dict]:
    """(tensor states for rng.pt, JSON-able states for trainer_state.json)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state_all()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    plain = {
        "python": [version, list(py_state), py_gauss],
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
    }
    return tensors, plain


def restore_rng(tensors: dict, plain: dict) -> None:
    """Every generator as `rng_snapshot` found it (CUDA's only where there is CUDA)."""
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda"])
    version, py_state, py_gauss = plain["python"]
    random.setstate((version, tuple(py_state), py_gauss))
    kind, keys, pos, has_gauss, gauss = plain["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
