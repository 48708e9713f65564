"""The tensors a model config implies, known without building the model.

A config read from a file (a run's config.yaml, an export's model_config.json, a Hugging Face
config.json) may describe any size: `n_layer: 1000000000` would take hours to build even on the
meta device, and `n_embd: 1000000` terabytes for real. `model_tensors` builds one block on the meta
device (no memory, no init) and repeats its shapes `n_layer` times on paper, so every size is known
in milliseconds, and `check_stored` compares it with the weights that came with the config (whose
sizes are bounded by the files they were read from) before anything of the config's size exists.
The pre-flight estimate reads its counts from here too, so `llmtrain check model.n_layer=10**9`
answers at once.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from llmtrain.config.schema import ModelConfig
from llmtrain.core.errors import UserError

Shape = tuple[int, ...]
BLOCK = re.compile(r"^blocks\.(\d+)\.")


@dataclass(frozen=True)
class ModelTensors:
    """The state dict of `GPT(cfg, vocab_size)` as shapes: the tensors outside the blocks (a tied
    head appears under both of its names, as in `state_dict()`), one block's (named without its
    `blocks.{i}.` prefix) and how many blocks; with the counts the estimates need."""

    cfg: ModelConfig
    vocab_size: int
    outside: dict[str, Shape]
    block: dict[str, Shape]
    outside_params: int  # unique: a tied head once
    block_matmul_params: int  # weights of one block's Linear layers
    head_matmul_params: int  # the LM head's weight (its matmul runs even when tied)
    buffer_elements: int  # non-persistent buffers (RoPE tables): built, never stored

    @property
    def n_layer(self) -> int:
        return self.cfg.n_layer

    @property
    def block_params(self) -> int:
        return sum(math.prod(shape) for shape in self.block.values())

    @property
    def n_params(self) -> int:
        """Unique parameters (tied weights once), as `model.param_count` counts the built model."""
        return self.outside_params + self.n_layer * self.block_params

    @property
    def n_tensors(self) -> int:
        """Entries of the state dict."""
        return len(self.outside) + self.n_layer * len(self.block)

    def unique_outside(self) -> dict[str, Shape]:
        """The tensors outside the blocks, a tied head once (under the embedding's name)."""
        return {name: shape for name, shape in self.outside.items()
                if not (self.cfg.tie_weights and name == "lm_head.weight")}

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls (the head's included, tied or not; the
        embedding lookups are no matmuls) plus causal attention (PaLM appendix B)."""
        tables = sum(math.prod(self.outside[name]) for name in ("wte.weight", "wpe.weight") if name in self.outside)
        n = self.n_params - tables + (self.head_matmul_params if self.cfg.tie_weights else 0)
        return 6.0 * n + 12.0 * self.n_layer * self.cfg.n_embd * seq_len

    def build_bytes(self, itemsize: int = 4) -> int:
        """Memory the built model holds: its parameters and its buffers."""
        return itemsize * (self.n_params + self.buffer_elements)

    def kv_cache_bytes(self, tokens: int, itemsize: int = 4) -> int:
        """A generation cache holding `tokens` positions (model.py KVCache): keys and values per layer."""
        from llmtrain.model import kv_heads

        return itemsize * 2 * self.n_layer * kv_heads(self.cfg) * (self.cfg.n_embd // self.cfg.n_head) * tokens

    def items(self) -> Iterator[tuple[str, Shape]]:
        """Every state-dict name with its shape (n_layer x the block's: bound n_layer first)."""
        yield from self.outside.items()
        for i in range(self.n_layer):
            for name, shape in self.block.items():
                yield f"blocks.{i}.{name}", shape


def model_tensors(cfg: ModelConfig, vocab_size: int) -> ModelTensors:
    """The shapes of `GPT(cfg, vocab_size)` from a one-block model on the meta device. `cfg` must
    have passed `config.validate.validate_model` (a head count of 0 would divide by zero here)."""
    from llmtrain.model import GPT, uninitialized

    with torch.device("meta"), uninitialized():
        model = GPT(dataclasses.replace(cfg, n_layer=1), vocab_size)
    state = model.state_dict()
    prefix = "blocks.0."
    unique = {id(p): p for name, p in model.named_parameters() if not name.startswith(prefix)}
    return ModelTensors(
        cfg=cfg,
        vocab_size=vocab_size,
        outside={name: tuple(t.shape) for name, t in state.items() if not name.startswith(prefix)},
        block={name.removeprefix(prefix): tuple(t.shape) for name, t in state.items() if name.startswith(prefix)},
        outside_params=sum(p.numel() for p in unique.values()),
        block_matmul_params=sum(m.weight.numel() for m in model.blocks[0].modules() if isinstance(m, nn.Linear)),
        head_matmul_params=model.lm_head.weight.numel(),
        buffer_elements=sum(b.numel() for b in model.buffers()),
    )


def stored_layers(names: Sequence[str] | Mapping[str, object], pattern: re.Pattern[str] = BLOCK) -> int:
    """How many blocks a set of stored tensor names holds: 1 + the highest block index (0 for none)."""
    found = [int(m.group(1)) for m in map(pattern.match, names) if m]
    return max(found) + 1 if found else 0


def layers_text(n: int) -> str:
    """"1 layer", "2 layers", "1,000,000,000 layers"."""
    return f"{n:,} layer{'' if n == 1 else 's'}"


def check_stored(tensors: ModelTensors, stored: Mapping[str, Shape], where: str, config_name: str) -> None:
    """Refuse (UserError) weights that are not exactly the model `tensors` describes: another
    number of blocks, a tensor missing, one too many, or one of another shape. `where` names the
    weights, `config_name` the file the description came from. The block count is compared first,
    so a description of a billion blocks is refused before its names are listed."""
    held = stored_layers(stored)
    if held != tensors.n_layer:
        raise UserError(f"{where}: {config_name} describes {layers_text(tensors.n_layer)} (n_layer), but the "
                        f"weights hold {held:,}; the config and the weights do not belong together.")
    expected = dict(tensors.items())
    missing = [name for name in expected if name not in stored]
    extra = [name for name in stored if name not in expected]
    wrong = [f"{name} is {tuple(stored[name])}, not {shape}" for name, shape in expected.items()
             if name in stored and tuple(stored[name]) != shape]
    problems = ([f"missing {', '.join(missing[:3])}"] if missing else []) + \
               ([f"not part of this model: {', '.join(extra[:3])}"] if extra else []) + wrong[:3]
    if problems:
        raise UserError(f"{where}: the weights do not fit the model {config_name} describes "
                        f"({tensors.n_params:,} parameters): {'; '.join(problems)}. The config and the weights do not "
                        "belong together.")
