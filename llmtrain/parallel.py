"""Process layout helpers: device choice and CPU threads per process.

Only a single process for now; DDP/FSDP2 wrapping and rank helpers will live here too.
"""

from __future__ import annotations

import os

import torch


def local_world_size() -> int:
    """Processes sharing this machine (set by torchrun; 1 otherwise)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def default_threads() -> int:
    """Cores divided among the local processes: more threads than cores only slows matmuls."""
    return max(1, usable_cores() // local_world_size())


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    from llmtrain.errors import ConfigError

    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"'device' is '{name}' but this torch build sees no CUDA device; use device=cpu or device=auto.")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"'device' is '{name}' but only {count} CUDA device(s) exist (cuda:0 to cuda:{count - 1}).")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"'device' is '{name}' but MPS is not available here; use device=cpu or device=auto.")
    return device
