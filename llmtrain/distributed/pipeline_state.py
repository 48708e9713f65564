"""The state views of a pipeline-parallel GPT (llmtrain/distributed/pipeline.py) in the plain single-
process format, as wrapping.py's and tensor_parallel.py's are: `state_dict()` gathers every stage's
part on the pipeline's first process (global rank 0 for the first pipeline; the others get {}),
`load_state_dict(full)` takes the whole state on every process and keeps each stage's part. Both
are collectives over the pipeline's processes. The stages are pipeline.py's StageModules (typed here
as nn.Module: pipeline.py imports this module, not the other way round).

Stages sharded by FSDP2 (pipeline with data parallel): their DTensors are gathered whole over the
data-parallel shards first (a collective of every process), then only the pipeline at data-parallel
position 0 (`gathers`) gathers them over its stages; the others return {} at once. Loading takes the
whole state on every process and keeps each process's shard.

The single-process order is rebuilt from the names: stages keep GPT's parameter names and register
their pieces in GPT's order, so the stages' lists concatenated in stage order (a tied weight's second
copy dropped) are the whole model's; and `build_optimizer`'s groups hold the parameters in that
order, so a group of the whole model's optimizer is the union of the stages' same group, ordered so.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed import ProcessGroup


# ---- merging (pure) --------------------------------------------------------------------------------

def merge_stage_states(per_stage: dict[int, dict[str, Any]], tie_weights: bool) -> dict[str, Any]:
    """The stages' state dicts as the whole model's: keys in GPT's order, a tied weight once (the
    first stage's) with `lm_head.weight` the very tensor of `wte.weight`, as GPT's state_dict has it."""
    out: dict[str, Any] = {}
    for stage in sorted(per_stage):
        for key, value in per_stage[stage].items():
            out.setdefault(key, value)
    if tie_weights and "wte.weight" in out and "lm_head.weight" in out:
        out["lm_head.weight"] = out["wte.weight"]
    return out


def global_groups(stage_names: dict[int, list[str]], group_names: Iterable[list[list[str]]]) -> list[list[str]]:
    """The whole model's optimizer groups as parameter names: `stage_names` each stage's parameter
    names in its order, `group_names` each process's optimizer groups (names). A parameter's place in
    its group is its place in the whole model (the stages in order, a repeated name once)."""
    position: dict[str, int] = {}
    for stage in sorted(stage_names):
        for name in stage_names[stage]:
            position.setdefault(name, len(position))
    merged: list[set[str]] = []
    for groups in group_names:
        for g, names in enumerate(groups):
            if g == len(merged):
                merged.append(set())
            merged[g].update(names)
    return [sorted(names, key=position.__getitem__) for names in merged]


# ---- the views --------------------------------------------------------------------------------------

class PipelineModelState:
    """The model's state in the plain full format (ShardedModelState's interface)."""

    def __init__(self, stages: Sequence[nn.Module], group: ProcessGroup | None = None, gathers: bool = True) -> None:
        self.stages, self.group, self.gathers = list(stages), group, gathers

    def parameters(self) -> Iterable[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for stage in self.stages:
            seen.update({id(p): p for p in stage.parameters()})
        return list(seen.values())

    def state_dict(self) -> dict:
        local = {s.stage_index: {k: _whole(v) for k, v in s.state_dict().items()} for s in self.stages}
        if not self.gathers:
            return {}
        gathered = _gather(local, self.group)
        if gathered is None:
            return {}
        per_stage = {index: state for states in gathered for index, state in states.items()}
        return merge_stage_states(per_stage, self.stages[0].cfg.tie_weights)

    def load_state_dict(self, state: dict) -> None:
        for stage in self.stages:
            own = stage.state_dict().keys()
            missing = [k for k in own if k not in state]
            if missing:
                raise KeyError(f"the state lacks {missing} (stage {stage.stage_index})")
            own_state = {k: state[k] for k in own}
            if _is_sharded(stage):  # each process keeps its shards of the whole tensors
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

                set_model_state_dict(stage, own_state, options=StateDictOptions(full_state_dict=True))
            else:
                stage.load_state_dict(own_state)


class PipelineOptimizerState:
    """This process's optimizer (over its stages' parameters, e.g. build_optimizer(RankModule(stages)))
    read and written as the whole model's optimizer (ShardedOptimizerState's interface): state keyed
    by parameter index in the single-process group order, the groups' settings as they are. A tied
    weight's state is the first stage's (its copy's is the same: same gradients, same updates)."""

    def __init__(self, stages: Sequence[nn.Module], optimizer: torch.optim.Optimizer,
                 group: ProcessGroup | None = None, gathers: bool = True) -> None:
        self.stages, self.optimizer, self.group, self.gathers = list(stages), optimizer, group, gathers
        names: dict[int, str] = {}
        for stage in self.stages:
            for name, param in stage.named_parameters():
                names.setdefault(id(param), name)
        self.local_groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        self.stage_names = {s.stage_index: [n for n, _ in s.named_parameters()] for s in self.stages}
        self._groups: list[list[str]] | None = None

    def state_dict(self) -> dict:
        opt = self.optimizer
        state = {}
        for names, group in zip(self.local_groups, opt.param_groups):
            for name, param in zip(names, group["params"]):
                if param in opt.state:
                    state[name] = {k: _whole(v) if isinstance(v, torch.Tensor) else v
                                   for k, v in opt.state[param].items()}
        if not self.gathers:
            return {}
        settings = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        gathered = _gather((self.stage_names, self.local_groups, settings, state), self.group)
        if gathered is None:
            return {}
        groups = global_groups({i: n for stage_names, *_ in gathered for i, n in stage_names.items()},
                               (local for _, local, _, _ in gathered))
        index = {name: i for i, name in enumerate(name for names in groups for name in names)}
        merged: dict[int, Any] = {}
        for *_, rank_state in gathered:
            for name, values in rank_state.items():
                merged.setdefault(index[name], values)
        param_groups = [{**_named(gathered[0][2][g], names), "params": [index[n] for n in names]}
                        for g, names in enumerate(groups)]
        return {"state": dict(sorted(merged.items())), "param_groups": param_groups}

    def load_state_dict(self, state: dict) -> None:
        groups = self._global_groups()
        saved = state["param_groups"]
        if len(saved) != len(groups) or any(len(s["params"]) != len(n) for s, n in zip(saved, groups)):
            raise ValueError(f"the optimizer state's groups ({[len(s['params']) for s in saved]} parameters) do not "
                             f"match this model's ({[len(n) for n in groups]})")
        by_name = {name: state["state"][i] for s, names in zip(saved, groups) for i, name in zip(s["params"], names)
                   if i in state["state"]}
        local: dict[str, Any] = {"state": {}, "param_groups": []}
        position = 0
        for g, (names, group) in enumerate(zip(self.local_groups, self.optimizer.param_groups)):
            for offset, (name, param) in enumerate(zip(names, group["params"])):
                if name in by_name:  # copies: stepping this optimizer must not step the caller's tensors
                    local["state"][position + offset] = {k: _like(v, param) if isinstance(v, torch.Tensor) else v
                                                         for k, v in by_name[name].items()}
            settings = {k: v for k, v in saved[g].items() if k != "params"}
            local["param_groups"].append({**_named(settings, names),
                                          "params": list(range(position, position + len(names)))})
            position += len(names)
        self.optimizer.load_state_dict(local)

    def _global_groups(self) -> list[list[str]]:
        """The whole model's groups as names (every process needs them to load: a collective, once)."""
        if self._groups is None:
            everyone = _all_gather((self.stage_names, self.local_groups), self.group)
            self._groups = global_groups({i: n for stage_names, _ in everyone for i, n in stage_names.items()},
                                         (local for _, local in everyone))
        return self._groups


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy of `tensor`, whole: a DTensor (an FSDP2 shard) gathered over its mesh (a
    collective of the processes sharing it: each calls this for the same tensors, in order)."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().cpu()


def _is_sharded(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor of the whole model as `param` holds it: this process's shard where
    the parameter is an FSDP2 DTensor and the value has its whole shape (moments); else a copy."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor) and value.shape == param.shape:
        # src_data_rank=None: every process holds the whole value and cuts its own shard (no traffic)
        return distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements,
                                 src_data_rank=None)
    return value.clone()


def _named(settings: dict, names: list[str]) -> dict:
    """A group's settings; its `param_names` (an optimizer built from named parameters) those given."""
    return {**settings, "param_names": list(names)} if "param_names" in settings else dict(settings)


def _gather(obj: Any, group: ProcessGroup | None) -> list[Any] | None:
    """Every process's `obj` on the pipeline's first process (in process order); None elsewhere.

    Only the structure travels pickled; its tensors go point to point, each received straight into
    a tensor of its own size. Pickling them (gather_object) held each stage's state four or five
    times over on the first process (the pickle, the receive buffer sized for the largest process
    times their count, the unpickled copy): measured 6.0 GiB for a 2-stage GPT-2 whose whole model
    and optimizer state are 1.4 GiB."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [obj]
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    dst, me = ranks[0], dist.get_rank()
    tensors: list[torch.Tensor] = []
    skeleton = _without_tensors(obj, tensors)
    skeletons = [None] * len(ranks) if me == dst else None
    dist.gather_object(skeleton, skeletons, dst=dst, group=group)
    if me != dst:
        for tensor in tensors:
            dist.send(tensor, dst=dst)
        return None
    out = [obj]
    for src, (structure, specs) in zip(ranks[1:], skeletons[1:]):
        received = []
        for shape, dtype in specs:
            tensor = torch.empty(shape, dtype=dtype)
            dist.recv(tensor, src=src)
            received.append(tensor)
        out.append(_with_tensors(structure, received))
    return out


class _Slot:
    """Where the `index`-th tensor of a gathered object was (`_without_tensors`)."""

    def __init__(self, index: int) -> None:
        self.index = index


def _without_tensors(obj: Any, tensors: list[torch.Tensor]) -> tuple[Any, list[tuple[tuple[int, ...], Any]]]:
    """`obj` (dicts, lists and tuples of tensors and plain values) with each tensor replaced by a
    `_Slot`, its contiguous CPU tensors appended to `tensors`; and their shapes and dtypes."""

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach().cpu().contiguous())
            return _Slot(len(tensors) - 1)
        if isinstance(value, dict):
            return {key: strip(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(item) for item in value)
        return value

    structure = strip(obj)
    return structure, [(tuple(t.shape), t.dtype) for t in tensors]


def _with_tensors(structure: Any, tensors: list[torch.Tensor]) -> Any:
    """`_without_tensors` undone: each `_Slot` back to its tensor."""
    if isinstance(structure, _Slot):
        return tensors[structure.index]
    if isinstance(structure, dict):
        return {key: _with_tensors(item, tensors) for key, item in structure.items()}
    if isinstance(structure, (list, tuple)):
        return type(structure)(_with_tensors(item, tensors) for item in structure)
    return structure


def _all_gather(obj: Any, group: ProcessGroup | None) -> list[Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
