"""GPT-style decoder: the classic GPT-2 recipe and a modern variant (RoPE, RMSNorm, SwiGLU).

One module, one config (`ModelConfig`); every architectural switch is a config field. Attention
always goes through `scaled_dot_product_attention` (fused kernels on CPU and GPU). The init
follows seed 003 §4: N(0, 0.02) weights, the last projection of every residual branch scaled down
(or zeroed) so a deep stack starts close to the identity, and optionally a zero or tiny LM head.

Generation goes through the same forward, given a `KVCache` (`GPT.forward(idx, cache)`): a prefill
of the prompt, then one token per forward against the cached keys and values of the earlier ones;
the attention takes the layer's cache and the position the new tokens start at (RoPE's and the
learned positions' offset). The sampling loop is llmtrain/generation.py.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.checkpointing import run_block
from llmtrain.config.schema import (
    HeadInit,
    MlpKind,
    ModelConfig,
    NormKind,
    NormPosition,
    PositionEncoding,
    ResidualInit,
)


def norm_eps(cfg: ModelConfig) -> float:
    """The norms' epsilon: model.norm_eps, else the usual default of the kind (GPT-2 1e-5, RMSNorm 1e-6)."""
    if cfg.norm_eps is not None:
        return cfg.norm_eps
    return 1e-6 if cfg.norm is NormKind.rmsnorm else 1e-5


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm is NormKind.rmsnorm:
        return nn.RMSNorm(cfg.n_embd, eps=norm_eps(cfg))
    return nn.LayerNorm(cfg.n_embd, eps=norm_eps(cfg), bias=cfg.bias)


def kv_heads(cfg: ModelConfig) -> int:
    return cfg.n_kv_head or cfg.n_head


def mlp_width(cfg: ModelConfig) -> int:
    """The MLP's hidden width: model.intermediate_size, else from mlp_ratio (swiglu: 2/3 of it,
    rounded up to a multiple of 8, which keeps the parameter count of a plain MLP of that ratio)."""
    if cfg.intermediate_size is not None:
        return cfg.intermediate_size
    hidden = int(cfg.mlp_ratio * cfg.n_embd)
    return 8 * math.ceil(2 * hidden / 3 / 8) if cfg.mlp is MlpKind.swiglu else hidden


def rope_tables(head_dim: int, length: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (length, head_dim) for rotate-half RoPE."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LayerCache:
    """One layer's keys and values (B, kv heads, capacity, head_dim), filled from position 0; the
    buffers are allocated on the first write, in the dtype the keys come in (autocast: bf16)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k and v at positions start.. and return the keys and values of every position so far."""
        end = start + k.shape[2]
        # (re)allocated at a prefill only: a step never changes batch, heads or dtype
        if start == 0 and (self.keys is None or self.keys.shape[:2] != k.shape[:2] or self.keys.dtype != k.dtype):
            shape = (*k.shape[:2], self.capacity, k.shape[3])
            self.keys = k.new_empty(shape)
            self.values = v.new_empty(shape)
        assert self.keys is not None and self.values is not None, "the first write is a prefill (start 0)"
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Keys and values of the tokens a model has read so far, per layer, for generating one token at
    a time (`GPT.forward(idx, cache)`): each step computes the new token's keys and values only,
    instead of the whole window's again. `length` tokens are held, at positions 0 .. length - 1; at
    most `capacity` of them (positions past the model's context were never trained). `reset` empties it."""

    def __init__(self, n_layer: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a KV cache holds at least 1 token, not {capacity}")
        self.capacity = capacity
        self.length = 0
        self.layers = [LayerCache(capacity) for _ in range(n_layer)]

    def reset(self) -> None:
        self.length = 0  # the buffers stay allocated: the next prefill overwrites them


# Sliding-window masks by (queries, keys, window, device): every layer of every forward at one length
# needs the same mask, so it is built once. Measured on 1 CPU thread (gpt_tiny's shape, batch 8,
# window 64, benchmarks/bench_sliding_window.py): an eval forward gains 3-4% (68.6 -> 65.8 ms at
# T=256, 702 -> 682 ms at T=1024), a training step nothing measurable; on a GPU it saves a few small
# kernel launches per layer. A few are kept: a sequence-length schedule, evaluation and generation
# use other lengths.
_BAND_MASKS: dict[tuple[int, int, int, torch.device], torch.Tensor] = {}
_BAND_MASKS_KEPT = 8


def band_mask(queries: int, keys: int, window: int, device: torch.device) -> torch.Tensor:
    """Sliding-window attention's boolean mask (queries, keys), True where a query attends: the
    queries are the last `queries` of the `keys` positions, and each sees itself and the window - 1
    keys before it (causal, and within the window). Built once per shape and device, then shared."""
    if torch.compiler.is_compiling():  # inside a compiled graph: built there (a Python dict is no graph op)
        return _band(queries, keys, window, device)
    key = (queries, keys, window, device)
    mask = _BAND_MASKS.get(key)
    if mask is None:
        # Never an inference tensor: a mask first built while generating (inference mode) may serve a
        # training forward later, and an attention kernel that saves its mask for backward refuses one.
        with torch.inference_mode(False):
            mask = _band(queries, keys, window, device)
        if len(_BAND_MASKS) >= _BAND_MASKS_KEPT:
            del _BAND_MASKS[next(iter(_BAND_MASKS))]  # the oldest
        _BAND_MASKS[key] = mask
    return mask


def _band(queries: int, keys: int, window: int, device: torch.device) -> torch.Tensor:
    rows = torch.arange(keys - queries, keys, device=device)[:, None]  # each query's position among the keys
    cols = torch.arange(keys, device=device)[None, :]
    return (cols <= rows) & (cols > rows - window)


class CausalSelfAttention(nn.Module):
    """Causal attention with one fused q/k/v projection, rows in the order [q | k | v] (GPT-2's
    c_attn, or Llama's q_proj, k_proj, v_proj stacked). With grouped-query attention k and v have
    n_kv_head heads, each shared by n_head / n_kv_head query heads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, kv_heads(cfg)
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.is_residual_output = True
        self.dropout_p = cfg.dropout  # SDPA takes a probability, not a module
        self.sliding_window = cfg.sliding_window  # None: full causal attention
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: LayerCache | None = None, start: int = 0) -> torch.Tensor:
        """x (B, T, C) holds the tokens at positions start.. (0 without a cache). With `cache` (generation)
        their keys and values join those of the `start` tokens before them, which they attend to too."""
        B, T, C = x.shape
        q, k, v = self._heads(self.qkv(x), B, T)
        if rope is not None:
            cos, sin = rope[0][start:start + T], rope[1][start:start + T]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.extend(k, v, start)
        window = self.sliding_window
        # Keys before the first query's window are seen by no query: left out (a generated token reads
        # only the last `window` keys of the cache).
        first = 0 if window is None else max(0, start + 1 - window)
        if first:
            k, v = k[:, :, first:], v[:, :, first:]
        k, v = self._repeat_kv(k, v)
        dropout_p = self.dropout_p if self.training else 0.0
        if window is not None and start + T > window:  # some query has keys beyond its window: the band mask
            mask = None if T == 1 else band_mask(T, start + T - first, window, x.device)  # one query sees all kept
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        elif start == 0:  # the whole sequence (training, or a prefill into the empty cache): plain causal attention
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:  # after cached tokens: query i (at position start + i) sees keys 0 .. start + i
            mask = None if T == 1 else torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(start)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        y = y.transpose(1, 2).reshape(B, T, -1)  # C, or this rank's heads' share under tensor parallelism
        y = self.proj(y)
        # Dropout is the identity in eval mode: its module call is skipped there (generation makes ~10
        # of them a token, a few percent of a small model's token on CPU).
        return self.resid_dropout(y) if self.training else y

    def _heads(self, qkv: torch.Tensor, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection's output (B, T, [q | k | v]) as q (B, n_head, T, head_dim) and k, v
        (B, n_kv_head, T, head_dim).

        Under tensor parallelism (llmtrain/distributed/tensor_parallel.py) `qkv` is a rank's share
        [q_r | k_r | v_r] of n_head / tp and n_kv_head / tp heads: the head counts come from its width
        (-1), and the split from the q : k : v proportions, which every rank's share keeps."""
        if self.n_kv_head == self.n_head:
            q, k, v = qkv.view(B, T, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            return q, k, v
        kv = qkv.shape[-1] * self.n_kv_head // (self.n_head + 2 * self.n_kv_head)
        q, k, v = qkv.split([qkv.shape[-1] - 2 * kv, kv, kv], dim=-1)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        return q, k, v

    def _repeat_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.n_kv_head == self.n_head:
            return k, v
        # Every kv head serves a group of consecutive query heads (Llama's repeat_kv); an
        # explicit repeat rather than SDPA's enable_gqa, which not every kernel of torch 2.5 takes.
        group = self.n_head // self.n_kv_head
        return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gated = cfg.mlp is MlpKind.swiglu
        hidden = mlp_width(cfg)
        if self.gated:
            self.gate = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.up = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.down = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.down.is_residual_output = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            h = F.silu(self.gate(x)) * self.up(x)
        else:
            h = F.gelu(self.up(x), approximate="tanh")
        h = self.down(h)
        return self.dropout(h) if self.training else h  # the identity in eval mode (see CausalSelfAttention)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pre_norm = cfg.norm_position is NormPosition.pre
        self.norm1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: LayerCache | None = None, start: int = 0) -> torch.Tensor:
        """x (B, T, C) at positions start..; `cache` and `start` as CausalSelfAttention.forward's."""
        if self.pre_norm:
            x = x + self.attn(self.norm1(x), rope, cache, start)
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.attn(x, rope, cache, start))
        return self.norm2(x + self.mlp(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.wte = nn.Embedding(vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.position is PositionEncoding.learned else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        # Post-LN blocks end in a norm already; pre-LN needs one before the head.
        self.norm_f = make_norm(cfg) if cfg.norm_position is NormPosition.pre else nn.Identity()
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        if cfg.position is PositionEncoding.rope:
            cos, sin = rope_tables(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        cfg = self.cfg
        for module in self.modules():
            if isinstance(module, nn.Linear):
                if cfg.init == "xavier":
                    nn.init.xavier_normal_(module.weight)
                elif cfg.init == "kaiming":
                    nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
                else:
                    nn.init.normal_(module.weight, mean=0.0, std=cfg.init_std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
                if getattr(module, "is_residual_output", False):
                    if cfg.residual_init is ResidualInit.zero:
                        nn.init.zeros_(module.weight)
                    elif cfg.residual_init is ResidualInit.scaled:
                        module.weight.mul_(1.0 / math.sqrt(2 * cfg.n_layer))
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=cfg.init_std)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        if not cfg.tie_weights:
            if cfg.head_init is HeadInit.zero:
                nn.init.zeros_(self.lm_head.weight)
            elif cfg.head_init is HeadInit.tiny:
                nn.init.normal_(self.lm_head.weight, mean=0.0, std=1e-4)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab).

        With `cache` (generation; see `new_cache`): idx follows the `cache.length` tokens the cache
        holds (none: a prefill), its keys and values join the cache and its positions continue from
        cache.length; the logits are those of the last position only, (B, 1, vocab): a token is
        sampled from them, and a prefill needs none for the prompt's own tokens. They are the
        forward's over the whole sequence (to float rounding). Dropout follows the model's mode, as
        always: generate in eval mode, without autograd (llmtrain/generation.py)."""
        x = self._residual_stream(idx, cache)
        if cache is not None:
            x = x[:, -1:]
        return self.lm_head(self.norm_f(x))

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> the final hidden states (B, T, n_embd), normed: the head's input.
        Evaluation applies the head only where it scores a token (llmtrain/evaluation/scoring.py)."""
        return self.norm_f(self._residual_stream(idx, None))

    def _residual_stream(self, idx: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """The last block's output (B, T, n_embd) for token ids (B, T) at positions start.. (the
        cache's length; 0 without one)."""
        T = idx.shape[1]
        start = 0 if cache is None else cache.length
        if cache is None and T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds the model's context {self.cfg.block_size}")
        if cache is not None and start + T > cache.capacity:
            raise ValueError(f"{start} cached + {T} new tokens exceed the cache's {cache.capacity}; reset it first")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(start, start + T, device=idx.device))
        if self.training:  # the identity in eval mode (see CausalSelfAttention.forward)
            x = self.drop(x)
        rope = (self.rope_cos, self.rope_sin) if self.rope_cos is not None else None
        if cache is not None:
            for block, layer in zip(self.blocks, cache.layers, strict=True):
                x = block(x, rope, layer, start)
            cache.length = start + T
            return x
        for index, block in enumerate(self.blocks):
            x = run_block(block, x, rope, index, self.cfg, self.training)  # checkpointed as the config asks
        return x

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty KV cache for `forward`, holding up to `capacity` tokens (default and most: the context)."""
        return KVCache(self.cfg.n_layer, min(capacity or self.cfg.block_size, self.cfg.block_size))


def param_count(model: nn.Module, exclude_positions: bool = False) -> int:
    """Unique parameters (tied weights counted once)."""
    seen = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in seen.values())
    wpe = getattr(model, "wpe", None)
    if exclude_positions and wpe is not None:
        total -= wpe.weight.numel()
    return total


# The torch.nn.init functions GPT's modules call while they are built (nn.Linear's own reset, then
# reset_parameters above).
_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
                   "trunc_normal_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def uninitialized() -> Iterator[None]:
    """Build models without their random init, for tensors that are overwritten next (a Hugging
    Face folder's weights) or never hold values (meta tensors, whose `normal_` imports torch._dynamo,
    ~1.3 s). The init is ~90% of the time to start GPT-2 small from a folder (3.3 s of 3.6 s on 2
    cores), draws from the RNG, and touches memory the load then writes anyway; transformers builds
    its models the same way (no_init_weights). torch.nn.init is patched for the duration (process-
    wide: build nothing else meanwhile) and restored on any exit."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, _unchanged)
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _unchanged(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor
