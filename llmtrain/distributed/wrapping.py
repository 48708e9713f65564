"""How a model and optimizer are wrapped for several processes: DDP, ZeRO-1, FSDP2, and the
state-dict views checkpoints read and write through."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from llmtrain.distributed.layout import Layout


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


def shard_model(model: torch.nn.Module, param_dtype: torch.dtype | None, mesh: Any = None) -> None:
    """FSDP2, in place: each block is its own shard unit (its parameters are gathered just for its
    forward and backward), then the root (embeddings, final norm, head: tied weights stay in one
    unit). Parameters become DTensors sharded over `mesh` (default: all ranks; a 2-D mesh is HSDP:
    replicated over its first dimension); gradients are reduce-scattered in float32. `param_dtype`
    (bf16/fp16 from the precision group) is the compute copy's type."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor for a result that may be a DTensor (a norm over sharded parameters): the
    reduction over the ranks happens here, a collective every rank must reach."""
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor that may be a DTensor (an FSDP2 shard; a view of its storage,
    no collective); any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


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


class ShardedAdapterState:
    """The adapters of an FSDP2-sharded LoRA model whose frozen weights come from a folder, in the
    plain full format (lora.py's AdapterState under FSDP2): `state_dict()` gathers the adapters
    alone on rank 0 (the other ranks get {}), never the frozen weights, which the folder holds;
    `load_state_dict` takes adapters whole on every rank and keeps each rank's shard, the frozen
    weights as they are. Both are collectives. The adapters are a small fraction of the model, so
    whole files cost little, and they read in one process or under any layout."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def parameters(self) -> Any:
        return self.model.parameters()

    def state_dict(self) -> dict:
        import torch.distributed as dist

        from llmtrain.lora import ADAPTER_MARK

        main = dist.get_rank() == 0
        adapters = {}
        # model.state_dict() names its entries in the same order on every rank: the gathers pair up.
        for name, tensor in self.model.state_dict().items():
            if ADAPTER_MARK in name:
                whole = local_value(tensor.detach())  # an all-gather for a sharded adapter
                if main:
                    adapters[name] = whole.cpu().clone()
        return adapters

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from llmtrain.lora import ADAPTER_MARK, check_adapters

        if any(ADAPTER_MARK not in name for name in state):  # a whole model (base + adapters): loaded whole
            set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))
            return
        check_adapters(state, {name for name in self.model.state_dict() if ADAPTER_MARK in name})
        # strict=False: the frozen weights, absent from `state`, keep their values (the folder's).
        set_model_state_dict(self.model, dict(state), options=StateDictOptions(full_state_dict=True, strict=False))


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
                 "param_groups": [{**g, "params": [self.names[int(i)] for i in g["params"]]}
                                  for g in state["param_groups"]]}
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
