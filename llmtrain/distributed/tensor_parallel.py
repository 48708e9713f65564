"""Tensor parallelism for GPT over torch DTensor (Megatron's split, planned as torchtitan does): each
of `tp` processes holds a slice of every matrix and computes its share of every layer.

- attention: the fused `qkv` split by output rows (whole heads per process), `proj` by input rows;
- MLP: `gate`/`up` by output rows, `down` by input rows;
- the embedding `wte` by vocabulary rows, the head `lm_head` by vocabulary rows with its logits
  gathered, so every process gets the whole (B, T, vocab) logits and the loss code is unchanged;
- norms, `wpe` and anything else replicated (or, with `sequence_parallel`, the norms run on the
  process's slice of the sequence): every parameter is a DTensor, as foreach AdamW requires.

The fused q/k/v projection holds its rows as [q | k | v]; sharding those rows as they are would give
process 0 all of q and half of k. Its rows are therefore permuted before sharding into per-process
groups [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (`permute_qkv`), and `CausalSelfAttention._heads` splits its
local output by the q : k : v proportions. The state views (`TensorParallelModelState`,
`TensorParallelOptimizerState`) undo the permutation, so checkpoints, `init_from` and exports keep
the plain single-process format.

Importing this module loads no torch (`tensor_parallel_problems` is meant for a config check before
any process starts): torch is imported inside the functions that need it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from llmtrain.config.parallel_limits import tensor_parallel_problems

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from llmtrain.model import GPT


# ---- refusals (no torch) ---------------------------------------------------------------------------

# ---- the q/k/v row permutation (pure) -----------------------------------------------------------------

def qkv_row_order(n_head: int, n_kv_head: int, head_dim: int, tp: int) -> list[int]:
    """For the fused projection's rows [q | k | v] (n_head, n_kv_head, n_kv_head heads of head_dim
    rows): the source row of each row of the per-process layout [q_0 k_0 v_0 | q_1 k_1 v_1 | ...],
    where process r holds query heads r*n_head/tp .. and kv heads r*n_kv_head/tp ..; so that an even
    split of the permuted rows (ColwiseParallel's Shard(0)) gives each process its own heads."""
    if n_head % tp or n_kv_head % tp:
        raise ValueError(f"tp={tp} must divide n_head={n_head} and n_kv_head={n_kv_head}")
    q, kv = n_head // tp * head_dim, n_kv_head // tp * head_dim  # rows of one process's q, of its k (and v)
    k_start, v_start = n_head * head_dim, (n_head + n_kv_head) * head_dim
    order: list[int] = []
    for r in range(tp):
        order += range(r * q, (r + 1) * q)
        order += range(k_start + r * kv, k_start + (r + 1) * kv)
        order += range(v_start + r * kv, v_start + (r + 1) * kv)
    return order


def permute_qkv(t: torch.Tensor, n_head: int, n_kv_head: int, tp: int) -> torch.Tensor:
    """Rows (dim 0) of a fused q/k/v weight, bias or same-shaped optimizer state from [q | k | v] to the
    per-process groups of `qkv_row_order`. A new tensor; `unpermute_qkv` is its inverse."""
    return t[_order(t, n_head, n_kv_head, tp)]


def unpermute_qkv(t: torch.Tensor, n_head: int, n_kv_head: int, tp: int) -> torch.Tensor:
    """The inverse of `permute_qkv`: per-process groups back to the plain [q | k | v] rows."""
    order = _order(t, n_head, n_kv_head, tp)
    out = t.new_empty(t.shape)
    out[order] = t
    return out


def _order(t: torch.Tensor, n_head: int, n_kv_head: int, tp: int) -> torch.Tensor:
    import torch

    head_dim, rest = divmod(t.shape[0], n_head + 2 * n_kv_head)
    if rest or head_dim == 0:
        raise ValueError(f"{t.shape[0]} rows are not (n_head + 2 * n_kv_head) = {n_head + 2 * n_kv_head} heads")
    return torch.tensor(qkv_row_order(n_head, n_kv_head, head_dim, tp), device=t.device)


# ---- applying it ---------------------------------------------------------------------------------------

def apply_tensor_parallel(model: GPT, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Split `model` in place across the processes of the 1-D `mesh` (every rank calls it, with the
    same weights: sharding scatters and replication broadcasts rank 0's). Afterwards every parameter
    is a DTensor, a tied head's weight is the embedding's very parameter, and the model's output is
    the whole logits on every rank. `sequence_parallel`: the residual stream between the layers holds
    each process's slice of the sequence (dim 1), the norms run on it; attention and the MLP gather
    it, and the final norm's output (the head's input, `hidden_states`) is gathered whole."""
    tp = mesh.size()
    # DTensor logs, every step, that a norm over a 2-D mesh (FSDP2 x tp) takes two collectives, not
    # one: true and harmless at these sizes, and it would bury the run's own output.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    problems = tensor_parallel_problems(model.cfg, model.vocab_size, tp, sequence_parallel=False, seq_len=None)
    if problems:
        raise ValueError(" ".join(problems))
    _permute_attention_rows(model, tp, permute_qkv)
    for block in model.blocks:
        _parallelize_block(block, mesh, sequence_parallel)
    _parallelize_ends(model, mesh, sequence_parallel)
    if model.cfg.tie_weights:  # the head's plan distributed its own copy: share the embedding's again
        model.lm_head.weight = model.wte.weight
    if sequence_parallel:
        _guard_sequence_parallel(model, tp)
    plain = [name for name, p in model.named_parameters() if not _is_dtensor(p)]
    if plain:  # a module the plan does not know: it would mix Tensors and DTensors in the optimizer
        raise RuntimeError(f"tensor parallel left plain parameters {plain}; add their modules to the plan")
    model._tensor_parallel_degree = tp  # the state views undo the q/k/v permutation of this degree


def _parallelize_block(block: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    plan: dict[str, Any] = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(output_layouts=between),
                            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=between)}
    if block.mlp.gated:
        plan["mlp.gate"] = ColwiseParallel()
    if sequence_parallel:
        # Plain local tensors out of the norms: with post-LN a norm's output is the residual stream itself.
        plan["norm1"] = SequenceParallel(use_local_output=True)
        plan["norm2"] = SequenceParallel(use_local_output=True)
        # Gather the sequence on entry (a DTensor inside, so that backward reduce-scatters the input's
        # gradient at once); attention's other inputs (rope tables, cache, start) pass through.
        plan["attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                          desired_input_layouts=(Replicate(), None, None, None))
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    parallelize_module(block, mesh, plan)
    if not sequence_parallel:
        _replicate(block.norm1, mesh)
        _replicate(block.norm2, mesh)


def _parallelize_ends(model: GPT, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """The embeddings, the final norm and the head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    between = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(model, mesh, {
        # A vocabulary-row slice per process: ids outside it look up zeros, the sum over processes
        # (all-reduce, or reduce-scatter onto sequence slices) is the embedding.
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        # The head's input is whole (see norm_f below); its logits are gathered whole on every rank.
        "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    })
    if model.wpe is not None:  # positions (T, C): each process adds its slice of the sequence's
        _replicate(model.wpe, mesh, output=Shard(0) if sequence_parallel else Replicate())
    has_params = any(True for _ in model.norm_f.parameters())  # nn.Identity under post-LN
    if not sequence_parallel:
        if has_params:
            _replicate(model.norm_f, mesh)
        return
    if has_params:
        parallelize_module(model.norm_f, mesh, SequenceParallel(use_local_output=True))
    # Gather the sequence after the final norm rather than in the head: the same all-gather, and
    # `hidden_states` (evaluation's head input) stays whole.
    parallelize_module(model.norm_f, mesh, PrepareModuleOutput(output_layouts=Shard(1),
                                                               desired_output_layouts=Replicate()))


def _guard_sequence_parallel(model: GPT, tp: int) -> None:
    """Refuse, rather than compute wrongly, what sequence parallel cannot take: a length `tp` does not
    divide (the slices would differ in size) and a KV cache (generation keeps the last position, which
    only one process holds). Checked at the embedding, which `forward` and `hidden_states` both pass."""

    def check_length(_module: nn.Module, args: tuple) -> None:
        length = args[0].shape[-1]
        if length % tp:
            raise ValueError(f"sequence parallel over tp={tp} processes needs a sequence length divisible by {tp}, "
                             f"not {length}")

    def check_cache(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        if (len(args) > 1 and args[1] is not None) or kwargs.get("cache") is not None:
            raise ValueError("a model split with sequence parallel cannot generate with a KV cache; generate with "
                             "the model in one process (its full state dict, TensorParallelModelState)")

    model.wte.register_forward_pre_hook(check_length)
    model.register_forward_pre_hook(check_cache, with_kwargs=True)


def _replicate(module: nn.Module, mesh: DeviceMesh, output: Any = None) -> None:
    """`module`'s parameters as Replicate DTensors (rank 0's values), its inputs taken as replicated
    plain tensors and its output handed back as a plain tensor of layout `output` (default Replicate;
    Shard(0): this process's slice of dim 0)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    output = output or Replicate()

    def inputs(_module: nn.Module, args: tuple, device_mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(a, device_mesh, [Replicate()], run_check=False)
                     if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

    def outputs(_module: nn.Module, out: DTensor, device_mesh: DeviceMesh) -> torch.Tensor:
        if out.placements != (output,):
            out = out.redistribute(device_mesh, [output])
        return out.to_local()

    distribute_module(module, mesh, None, inputs, outputs)


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _permute_attention_rows(model: GPT, tp: int, reorder: Callable[..., torch.Tensor]) -> None:
    """Every attention's fused q/k/v weight and bias reordered in place (plain tensors, before sharding)."""
    import torch

    with torch.no_grad():
        for key, (n_head, n_kv_head) in _qkv_keys(model).items():
            param = model.get_parameter(key)
            param.copy_(reorder(param, n_head, n_kv_head, tp))


def _qkv_keys(model: nn.Module) -> dict[str, tuple[int, int]]:
    """State-dict key of each fused q/k/v weight and bias -> (n_head, n_kv_head) of its attention."""
    from llmtrain.model import CausalSelfAttention

    keys = {}
    for name, module in model.named_modules():
        if isinstance(module, CausalSelfAttention):
            for kind in ("weight", "bias"):
                if getattr(module.qkv, kind) is not None:
                    keys[f"{name}.qkv.{kind}"] = (module.n_head, module.n_kv_head)
    return keys


def tensor_parallel_degree(model: nn.Module) -> int:
    """The tp `apply_tensor_parallel` split `model` across (1: not split)."""
    return int(getattr(model, "_tensor_parallel_degree", 1))


# ---- state views in the plain single-process format ---------------------------------------------------

class TensorParallelModelState:
    """A tensor-parallel model's state in the plain full format (wrapping.ShardedModelState's
    interface): `state_dict()` gathers it on rank 0 (the other ranks get {}) with the q/k/v rows back in
    [q | k | v] order; `load_state_dict` takes a full dict on every rank. Both are collectives. It wraps
    rather than subclasses ShardedModelState: a sharded (FSDP2) checkpoint must reach this model through
    `load_state_dict`, which permutes, not through a direct DCP read into its parameters."""

    def __init__(self, model: nn.Module) -> None:
        from llmtrain.distributed.wrapping import ShardedModelState

        self.model = model
        self.full = ShardedModelState(model)
        self.qkv = _qkv_keys(model)
        self.tp = tensor_parallel_degree(model)

    def parameters(self) -> Iterable[nn.Parameter]:
        return self.model.parameters()

    def state_dict(self) -> dict:
        state = self.full.state_dict()
        return _reordered(state, self.qkv, self.tp, unpermute_qkv) if state else state

    def load_state_dict(self, state: dict) -> None:
        self.full.load_state_dict(_reordered(state, self.qkv, self.tp, permute_qkv))


class TensorParallelOptimizerState:
    """The optimizer of a tensor-parallel model in the plain optimizer's format (state keyed by
    parameter index in group order; wrapping.ShardedOptimizerState's interface), every state tensor of a
    q/k/v parameter's shape (exp_avg, exp_avg_sq, ...) with its rows in [q | k | v] order."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.tensor import Replicate

        from llmtrain.distributed.wrapping import ShardedOptimizerState

        self.model, self.optimizer = model, optimizer
        self.full = ShardedOptimizerState(model, optimizer)
        self.tp, qkv = tensor_parallel_degree(model), _qkv_keys(model)
        params = [model.get_parameter(name) for name in self.full.names]
        # parameter index -> (n_head, n_kv_head, shape) for the q/k/v weights and biases
        self.qkv = {i: (*qkv[name], tuple(params[i].shape)) for i, name in enumerate(self.full.names) if name in qkv}
        # indices of the parameters whole on every rank: their state is loaded as the given tensors themselves
        self.replicated = {i for i, p in enumerate(params)
                           if all(isinstance(pl, Replicate) for pl in getattr(p, "placements", ()))}

    def state_dict(self) -> dict:
        state = self.full.state_dict()
        return self._reordered(state, unpermute_qkv, own=False) if state else state

    def load_state_dict(self, state: dict) -> None:
        self.full.load_state_dict(self._reordered(state, permute_qkv, own=True))

    def _reordered(self, state: dict, reorder: Callable[..., torch.Tensor], own: bool) -> dict:
        """`state` with the q/k/v parameters' state tensors reordered. `own` (a load): copies, too, of the
        tensors torch's loader would keep as they are (the step counts, a replicated parameter's state),
        so the optimizer never shares a tensor with the caller's dict (stepping one would step both)."""
        import torch

        per_param = {}
        for key, values in state["state"].items():
            index = int(key)
            if index in self.qkv:
                n_head, n_kv_head, shape = self.qkv[index]
                values = {name: reorder(v, n_head, n_kv_head, self.tp)
                          if isinstance(v, torch.Tensor) and tuple(v.shape) == shape else v
                          for name, v in values.items()}
            if own:
                values = {name: v.clone() if isinstance(v, torch.Tensor) and (v.dim() == 0 or index in self.replicated)
                          else v for name, v in values.items()}
            per_param[key] = values
        return {**state, "state": per_param}


def _reordered(state: dict, qkv: dict[str, tuple[int, int]], tp: int, reorder: Callable[..., torch.Tensor]) -> dict:
    """A shallow copy of a model state dict with the q/k/v entries reordered (the caller's dict is kept)."""
    out = dict(state)
    for key, (n_head, n_kv_head) in qkv.items():
        if key in out:
            out[key] = reorder(out[key], n_head, n_kv_head, tp)
    return out
