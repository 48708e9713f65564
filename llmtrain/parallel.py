"""Process layout: device choice, CPU threads per process, and the torch.distributed side of
parallel=ddp (process group, the few collectives the loop needs, starting local workers).

A distributed run is several processes that each run the whole train loop on their own slice of
every batch; `Layout` says which one this is. Rank 0 alone prints and writes files.
"""

from __future__ import annotations

import datetime
import inspect
import os
import pickle
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def local_world_size() -> int:
    """Processes sharing this machine (set by torchrun; 1 otherwise)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def default_threads() -> int:
    """Cores divided among the local processes: more threads than cores only slows matmuls. A
    SLURM task (hydra/launcher=slurm) has cpus_per_task cores of its own, shared with nobody."""
    slurm_cores = os.environ.get("SLURM_CPUS_PER_TASK")
    if slurm_cores and os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        return max(1, min(usable_cores(), int(slurm_cores)))
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


@dataclass(frozen=True)
class Layout:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

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
    if layout.distributed and dist.is_initialized():  # a SIGTERM while setting up can stop a rank before the group starts
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


def zero_redundancy(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """ZeRO-1: the same optimizer (class, groups, settings), its state split across the ranks; each
    rank steps its shard of the parameters and broadcasts them. Its state_dict, once consolidated
    on rank 0, has the plain optimizer's format, so checkpoints move between single, ddp and zero1."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    accepted = inspect.signature(type(optimizer).__init__).parameters
    # defaults may hold keys the constructor does not take (AdamW's decoupled_weight_decay, torch 2.13)
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(group) for group in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **settings)


def shard_model(model: torch.nn.Module, param_dtype: torch.dtype | None) -> None:
    """FSDP2, in place: each block is its own shard unit (its parameters are gathered just for its
    forward and backward), then the root (embeddings, final norm, head: tied weights stay in one
    unit). Parameters become DTensors sharded over the ranks; gradients are reduce-scattered in
    float32. `param_dtype` (bf16/fp16 from the precision group) is the compute copy's type."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor for a result that may be a DTensor (a norm over sharded parameters): the
    reduction over the ranks happens here, a collective every rank must reach."""
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def _full_options() -> Any:
    """Whole tensors, gathered to rank 0's CPU memory (the other ranks get nothing)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


class ShardedModelState:
    """An FSDP2 model's state in the plain full format: `state_dict()` gathers it on rank 0 (the
    other ranks get {}), `load_state_dict` takes a full dict on every rank and keeps each rank's
    shard. Both are collectives (torch.distributed.checkpoint.state_dict)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def parameters(self) -> Any:
        return self.model.parameters()

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model, options=_full_options())

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))


class ShardedOptimizerState:
    """The optimizer of an FSDP2 model, read and written in the plain optimizer's format (state
    keyed by parameter index in group order, as `torch.optim.Optimizer.state_dict` has it), so its
    checkpoints load in one process and back. torch's full format keys by parameter name."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        names = {id(p): name for name, p in model.named_parameters()}
        self.names = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        full = get_optimizer_state_dict(self.model, self.optimizer, options=_full_options())
        if not full:
            return {}
        index = {name: i for i, name in enumerate(self.names)}
        return {"state": {index[name]: value for name, value in full["state"].items()},
                "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in full["param_groups"]]}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        named = {"state": {self.names[int(i)]: value for i, value in state["state"].items()},
                 "param_groups": [{**g, "params": [self.names[int(i)] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(self.model, self.optimizer, named, options=StateDictOptions(full_state_dict=True))


class ConsolidatedOptimizerState:
    """A ZeroRedundancyOptimizer read as one optimizer: `state_dict()` gathers the shards on rank 0
    (a collective; the other ranks get {}); the format is the plain optimizer's."""

    def __init__(self, optimizer: Any, layout: Layout) -> None:
        self.optimizer, self.layout = optimizer, layout

    def state_dict(self) -> dict:
        self.optimizer.consolidate_state_dict(to=0)
        return self.optimizer.state_dict() if self.layout.is_main else {}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_local(nproc: int, target: Any, payload: Any) -> None:
    """Start `nproc` worker processes on this machine, as torchrun would (RANK, WORLD_SIZE, ... set),
    each calling `target(payload)`. Returns when all succeed. When one fails, the others are
    stopped and torch's ProcessExitedException / ProcessRaisedException names the rank."""
    import torch.multiprocessing as mp

    from llmtrain.interrupts import StopRequest

    port = free_port()
    context = mp.start_processes(_worker, args=(nproc, port, target, pickle.dumps(payload)), nprocs=nproc,
                                 start_method="spawn", join=False)
    # SIGTERM or Ctrl-C to this parent is passed on to the ranks, which decide (finish the step and
    # save, or abort on a second one; a rank that got it directly too counts it once); this parent
    # waits for them rather than dying first (their exit codes say what happened).
    with StopRequest.shared().relaying(context.pids()):
        while not context.join():
            pass


def _worker(rank: int, nproc: int, port: int, target: Any, payload: bytes) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    target(pickle.loads(payload))
