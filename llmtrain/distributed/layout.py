"""Process layout: device choice, CPU threads per process (threads=auto measures the free cores:
distributed/cores.py), and the torch.distributed side of a run of several processes (process
group, the few collectives the loop needs). How the processes
start is llmtrain.training.launch; how the model is wrapped, llmtrain.distributed.wrapping.

A distributed run is several processes that each run the whole train loop on their own slice of
every batch; `Layout` says which one this is. Rank 0 alone prints and writes files.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.config.threads import parse_threads
from llmtrain.distributed.cores import ThreadChoice, auto_threads, cgroup_cpu_quota, usable_cores


def local_world_size() -> int:
    """Processes sharing this machine (set by torchrun; 1 otherwise)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def default_threads() -> int:
    """Cores divided among the local processes, not measured: more threads than cores only slows
    matmuls. A SLURM task (hydra/launcher=slurm) has cpus_per_task cores of its own, shared with nobody."""
    slurm_cores = slurm_task_cores()
    if slurm_cores:
        return max(1, min(usable_cores(), slurm_cores))
    return max(1, usable_cores() // local_world_size())


def slurm_task_cores() -> int | None:
    """cpus_per_task of a SLURM task started by hydra/launcher=slurm (None elsewhere)."""
    slurm_cores = os.environ.get("SLURM_CPUS_PER_TASK")
    if slurm_cores and slurm_cores.isdigit() and os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        return int(slurm_cores)
    return None


def resolve_threads(setting: object, layout: Layout,
                    measure: Callable[[int], ThreadChoice] | None = None) -> ThreadChoice:
    """The thread count per process: the config's count, or (threads=auto, or null from an older
    config) the free cores measured now, divided among the local processes. Rank 0 measures while
    the others wait, and every rank takes its answer: the ranks agree, and a rank's own start-up
    work cannot count as another process's."""
    count = parse_threads(setting)
    if count is not None:
        return ThreadChoice(count)
    measure = measure or (lambda procs: auto_threads(procs, quota=cgroup_cpu_quota(), slurm_cores=slurm_task_cores()))
    return broadcast_from_main(measure(local_world_size()) if layout.is_main else None, layout)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    from llmtrain.core.errors import ConfigError

    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"'device' is '{name}' but this torch build sees no CUDA device; "
                              "use device=cpu or device=auto.")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"'device' is '{name}' but only {count} CUDA device(s) exist "
                              f"(cuda:0 to cuda:{count - 1}).")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"'device' is '{name}' but MPS is not available here; use device=cpu or device=auto.")
    return device


@dataclass(frozen=True)
class Layout:
    """This process's place in the run. The `tp` x `pp` ranks of one data-parallel rank (its tensor-
    parallel ranks and pipeline stages: the device mesh's innermost and outermost dimensions) read
    the same batch; the data-parallel ranks split it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    tp: int = 1
    pp: int = 1

    @property
    def copies(self) -> int:
        """Ranks that read each data-parallel rank's batch."""
        return self.tp * self.pp

    @property
    def dp_rank(self) -> int:
        """Which share of each global batch this rank reads."""
        return (self.rank // self.tp) % self.dp_size

    @property
    def dp_size(self) -> int:
        """How many shares the global batch is split into."""
        return self.world_size // self.copies

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def layout_from_env() -> Layout:
    """Set by torchrun, or by `spawn_local` for parallel.nproc; a single process otherwise."""
    env = os.environ
    return Layout(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


def start_process_group(layout: Layout, device: torch.device) -> None:
    """Join the run's process group (gloo on CPU, NCCL on CUDA); nothing for one process."""
    if layout.distributed and not dist.is_initialized():
        # On CUDA, NCCL for the tensors and gloo for the loop's small host-side collectives (token
        # counts, stop/save votes). The timeout covers rank 0 preparing a large corpus while the
        # others wait (NCCL's default watchdog would kill them after 10 minutes).
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, rank=layout.rank, world_size=layout.world_size,
                                timeout=datetime.timedelta(hours=2), **kwargs)


def end_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(layout: Layout) -> None:
    # a SIGTERM while setting up can stop a rank before the group starts
    if layout.distributed and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: list[float], layout: Layout) -> list[float]:
    """Element-wise sum over the ranks (float64 on the host: token counts stay exact)."""
    if not layout.distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.tolist()


def broadcast_from_main(value: Any, layout: Layout) -> Any:
    """Rank 0's `value` on every rank (pickled): decisions that must be the same everywhere."""
    if not layout.distributed:
        return value
    box = [value if layout.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
