"""LoRA (Hu et al. 2021), native: low-rank adapters beside frozen linear layers of a GPT.

`LoRALinear` is an `nn.Linear` whose weight and bias are the original layer's (same parameters,
same state-dict names, frozen) plus adapters: y = W x + b + (alpha / rank) * B A dropout(x), with A
(rank x in) drawn as peft draws it (kaiming-uniform, a = sqrt(5)) and B (out x rank) zeros, so the
model's output is exactly the base model's at the start.

A layer's output rows may be split into parts with one adapter pair each. The attention's fused
q/k/v projection (rows q | k | v, k and v narrower under grouped-query attention) has three, named
q, k and v: each acts on its own row block, exactly as separate adapters on Llama's q_proj, k_proj
and v_proj would, so they can be exported or merged per projection. Every other target has one
part, named `w`.

The state dict of an adapted layer holds `<layer>.lora_a.<part>`, `<layer>.lora_b.<part>` and
`<layer>.lora_scaling` (alpha / rank, a buffer): a LoRA run's weights describe their own merge, so
`merged_state_dict` turns any of them (a checkpoint's, model.pt) into the plain model's without the
run's config. `apply_lora` adapts a built model in place (finetune=qlora: then stores its frozen
base in 4 bits, qlora.py), `merge_lora` folds the adapters back in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.config.finetune import FinetuneConfig, FinetuneMethod
from llmtrain.config.schema import MlpKind, ModelConfig
from llmtrain.model import kv_heads, mlp_width

ADAPTER_MARK = ".lora_"  # in every adapter tensor's state-dict name, and in no base tensor's
PART_ORDER = ("q", "k", "v", "w")  # the row blocks' order within a layer's output


class LoRALinear(nn.Linear):
    """A frozen linear layer with a LoRA adapter per part of its output rows (`parts`: name -> rows,
    in row order)."""

    def __init__(self, base: nn.Linear, parts: dict[str, int], rank: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: the base's weight is kept, not a new one allocated
        if sum(parts.values()) != base.out_features:
            raise ValueError(f"the parts' rows {parts} do not add up to the layer's {base.out_features} outputs")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        for name, value in vars(base).items():  # plain attributes such as is_residual_output
            if not name.startswith("_") and name not in ("in_features", "out_features", "training"):
                setattr(self, name, value)
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device, dtype = base.weight.device, base.weight.dtype
        # The row blocks' order, kept apart: a ParameterDict built from a dict sorts its keys (k, q, v).
        self.parts = tuple(parts)
        self.lora_a = nn.ParameterDict({
            name: nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=dtype)) for name in parts})
        self.lora_b = nn.ParameterDict({
            name: nn.Parameter(torch.zeros(rows, rank, device=device, dtype=dtype)) for name, rows in parts.items()})
        for a in self.lora_a.values():
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # peft's (and nn.Linear's) init of A
        # A buffer, saved with the adapters: merging a state dict needs no config.
        self.register_buffer("lora_scaling", torch.tensor(alpha / rank, device=device, dtype=torch.float32))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        h = self.lora_dropout(x) if self.training else x
        deltas = [F.linear(F.linear(h, self.lora_a[name]), self.lora_b[name]) for name in self.parts]
        delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)
        return out + delta * self.lora_scaling.to(delta.dtype)

    def delta_weight(self) -> torch.Tensor:
        """(alpha / rank) * B A for every part, stacked in row order: what merging adds to the weight (in fp32)."""
        blocks = [self.lora_b[name].float() @ self.lora_a[name].float() for name in self.parts]
        return torch.cat(blocks, dim=0) * self.lora_scaling.float()

    def extra_repr(self) -> str:
        rank = next(iter(self.lora_a.values())).shape[0]
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={rank}, "
                f"scaling={self.lora_scaling.item():g}, parts={list(self.parts)}")


@dataclass(frozen=True)
class Target:
    """One adapted layer: its path in the model (state-dict prefix) and its parts' rows."""

    path: str
    parts: dict[str, int]


def lora_targets(model_cfg: ModelConfig, finetune: FinetuneConfig, vocab_size: int) -> list[Target]:
    """The layers finetune.targets adapts in a GPT of this config, in module order."""
    chosen = set(finetune.targets)
    head_dim = model_cfg.n_embd // model_cfg.n_head
    q_rows, kv_rows = model_cfg.n_head * head_dim, kv_heads(model_cfg) * head_dim
    hidden, width = mlp_width(model_cfg), model_cfg.n_embd
    found = []
    for i in range(model_cfg.n_layer):
        if "attn_qkv" in chosen:
            found.append(Target(f"blocks.{i}.attn.qkv", {"q": q_rows, "k": kv_rows, "v": kv_rows}))
        if "attn_out" in chosen:
            found.append(Target(f"blocks.{i}.attn.proj", {"w": width}))
        if "mlp" in chosen:
            gates = ["gate"] if model_cfg.mlp is MlpKind.swiglu else []
            found += [Target(f"blocks.{i}.mlp.{name}", {"w": hidden}) for name in (*gates, "up")]
            found.append(Target(f"blocks.{i}.mlp.down", {"w": width}))
    if "head" in chosen:
        found.append(Target("lm_head", {"w": vocab_size}))
    return found


def in_features(model_cfg: ModelConfig, path: str) -> int:
    """The input width of a target layer (the MLP's down projection reads the hidden width)."""
    return mlp_width(model_cfg) if path.endswith("mlp.down") else model_cfg.n_embd


def adapter_shapes(model_cfg: ModelConfig, finetune: FinetuneConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """The adapters' parameters by state-dict name, as shapes (nothing is built): for the estimate."""
    shapes: dict[str, tuple[int, ...]] = {}
    for target in lora_targets(model_cfg, finetune, vocab_size):
        for name, rows in target.parts.items():
            shapes[f"{target.path}.lora_a.{name}"] = (finetune.rank, in_features(model_cfg, target.path))
            shapes[f"{target.path}.lora_b.{name}"] = (rows, finetune.rank)
    return shapes


def apply_lora(model: nn.Module, finetune: FinetuneConfig) -> int:
    """Freeze every parameter of `model` (a GPT) and put adapters on finetune.targets, in place;
    finetune=qlora: then store the base's linear weights in NF4 (qlora.py quantize_base). Returns
    the adapters' parameter count (what now trains)."""
    for param in model.parameters():
        param.requires_grad_(False)
    targets = lora_targets(model.cfg, finetune, model.lm_head.out_features)
    if any(t.path == "lm_head" for t in targets) and model.lm_head.weight is model.wte.weight:
        raise ValueError("an adapter on a head tied to the embedding would untie them")
    for target in targets:
        parent_path, _, name = target.path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        base = getattr(parent, name)
        setattr(parent, name, LoRALinear(base, target.parts, finetune.rank, finetune.alpha, finetune.dropout))
    if finetune.method == FinetuneMethod.qlora:  # after the adapters: the head's weight is quantized when adapted
        from llmtrain.qlora import quantize_base

        quantize_base(model)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight (W += scaling * B A) and put plain nn.Linear layers back, in
    place: the model is then an ordinary GPT, with the adapted model's outputs (to float rounding)."""
    for path, module in list(model.named_modules()):
        if not isinstance(module, LoRALinear):
            continue
        with torch.no_grad():
            # as merged_state_dict computes it: in fp32, then in the weight's dtype
            module.weight.copy_((module.weight.float() + module.delta_weight()).to(module.weight.dtype))
        plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                          device="meta")  # its own tensors replaced next: nothing allocated
        plain.weight, plain.bias = module.weight, module.bias
        for name, value in vars(module).items():
            if not name.startswith("_") and name not in ("in_features", "out_features", "training", "parts"):
                setattr(plain, name, value)
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, name, plain)
    return model


def has_adapters(state: dict[str, torch.Tensor]) -> bool:
    return any(ADAPTER_MARK in name for name in state)


def merged_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA run's state dict (base weights + adapters + scalings) as the plain model's: each adapted
    weight plus scaling * B A (parts stacked in row order, computed in fp32), the adapter entries
    dropped. A state dict without adapters comes back as it is."""
    if not has_adapters(state):
        return state
    layers = {name[: -len(".lora_scaling")] for name in state if name.endswith(".lora_scaling")}
    merged = {name: tensor for name, tensor in state.items() if ADAPTER_MARK not in name}
    for layer in sorted(layers):
        parts = sorted((name.rsplit(".", 1)[1] for name in state if name.startswith(f"{layer}.lora_b.")),
                       key=lambda part: PART_ORDER.index(part) if part in PART_ORDER else len(PART_ORDER))
        blocks = [state[f"{layer}.lora_b.{p}"].float() @ state[f"{layer}.lora_a.{p}"].float() for p in parts]
        weight = state[f"{layer}.weight"]
        delta = torch.cat(blocks, dim=0) * state[f"{layer}.lora_scaling"].float()
        merged[f"{layer}.weight"] = (weight.float() + delta).to(weight.dtype)
    return merged


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a LoRA state dict (A, B and each layer's scaling): what a LoRA run changed."""
    return {name: tensor for name, tensor in state.items() if ADAPTER_MARK in name}


class AdapterState:
    """The state view of an adapted model whose frozen weights come from a folder (model.init_from):
    `state_dict()` holds the adapters alone (A, B, scalings), so a checkpoint and model.pt hold what
    the run changed, not a copy of the base. `load_state_dict` takes such a state (the base weights,
    loaded from the folder and frozen, stay as they are) or a whole one (base + adapters, as
    checkpoints held before adapter-only ones; loaded whole)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return adapter_state(self.model.state_dict())

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if any(ADAPTER_MARK not in name for name in state):
            self.model.load_state_dict(state)
            return
        check_adapters(state, set(self.state_dict()))
        self.model.load_state_dict(state, strict=False)


def check_adapters(state: dict[str, torch.Tensor], expected: set[str]) -> None:
    """Raise unless `state` holds exactly the adapter entries `expected` (a model's)."""
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:  # RuntimeError, as load_state_dict raises: the resume turns it into a refusal
        raise RuntimeError(f"the adapters do not fit this model (missing: {', '.join(missing[:3]) or 'none'}; "
                           f"unexpected: {', '.join(extra[:3]) or 'none'})")


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) unique parameters of a built model (tied weights once)."""
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() for p in unique.values() if p.requires_grad), sum(p.numel() for p in unique.values())
