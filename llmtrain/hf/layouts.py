"""The two Hugging Face layouts llmtrain reads and writes: GPT2LMHeadModel and LlamaForCausalLM
(with MistralForCausalLM, Llama's layout with sliding-window attention, as its windowed form).

For each, what a config.json means in llmtrain's `ModelConfig` fields (`model_fields`), the
config.json an llmtrain model exports as (`hf_config`), and which HF tensors make up each llmtrain
tensor (`pieces`): GPT-2's Conv1D weights are stored (in, out), so they are transposed; Llama's
q_proj, k_proj and v_proj are stacked into llmtrain's one fused q/k/v projection (rows q | k | v,
as GPT-2's c_attn already is). RoPE is rotate-half in both llmtrain and Llama, so q and k need no
permutation (tests/test_hf_init.py proves the logits equal). Anything else a config asks for is refused
by name, with the values that would be accepted: a model that loads "mostly" would train on
logits that are not the checkpoint's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from llmtrain.config.schema import MlpKind, ModelConfig, NormKind, NormPosition, PositionEncoding
from llmtrain.core.errors import ConfigError

GPT2 = "gpt2"
LLAMA = "llama"
MISTRAL = "mistral"  # Llama's tensors and recipe, with sliding-window attention (model.sliding_window)
GPT2_NAME, LLAMA_NAME, MISTRAL_NAME = "GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM"
ARCHITECTURES = {GPT2_NAME: GPT2, LLAMA_NAME: LLAMA, MISTRAL_NAME: LLAMA}
MODEL_TYPES = {GPT2: GPT2, LLAMA: LLAMA, MISTRAL: LLAMA}  # model_type, for a config.json without architectures
# MistralConfig's window when config.json has no sliding_window key at all (an explicit null: none).
MISTRAL_DEFAULT_WINDOW = 4096
# GELU's tanh approximation, llmtrain's (F.gelu(approximate="tanh")), under HF's names for it.
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
# The ModelConfig fields a folder's config.json decides (init_from compares and fills these).
SHAPE_FIELDS = ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "vocab_size", "intermediate_size",
                "rope_theta", "norm_eps", "bias", "tie_weights", "position", "norm", "mlp", "norm_position",
                "sliding_window")


class UnsupportedModel(ConfigError):
    """A config.json (or an llmtrain model) that has no equivalent in the other library."""


def layout_of_config(config: dict[str, Any], where: str) -> str:
    """GPT2 or LLAMA (Mistral included) for a config.json; UnsupportedModel names the supported architectures."""
    return MODEL_TYPES[architecture_of_config(config, where)]


def architecture_of_config(config: dict[str, Any], where: str) -> str:
    """GPT2, LLAMA or MISTRAL for a config.json; UnsupportedModel names the supported architectures."""
    architectures = config.get("architectures") or []
    if isinstance(architectures, str):  # one name where transformers writes a list of them
        architectures = [architectures]
    if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
        raise UnsupportedModel(f"{where}: architectures is {_shown(architectures)}; it lists model class names, e.g. "
                               f"[\"GPT2LMHeadModel\"]. The file is damaged: download or save the model again.")
    for name in architectures:
        if name in ARCHITECTURES:
            return MISTRAL if name == MISTRAL_NAME else ARCHITECTURES[name]
    model_type = config.get("model_type")
    if not architectures and model_type in MODEL_TYPES:
        return model_type
    found = ", ".join(architectures) or f"model_type {_shown(model_type)}"
    raise UnsupportedModel(
        f"{where} describes a {found} model; llmtrain reads {', '.join(ARCHITECTURES)} (model_type gpt2, llama or "
        "mistral: GPT-2, DistilGPT-2, SmolLM, TinyLlama, Llama 2, Mistral and other Llama-family checkpoints without "
        "rope scaling)."
    )


def model_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The `ModelConfig` field values (SHAPE_FIELDS) of a GPT-2, Llama or Mistral config.json. Every value is
    read as the JSON type it must have (an integer, a finite number, true or false, an object): a
    value of another type is refused by name, never converted (`"n_layer": true` is not 1, and
    `"tie_word_embeddings": "no"` is not true)."""
    architecture = architecture_of_config(config, where)
    values = _Values(config, where)
    fields = _gpt2_fields(values) if architecture == GPT2 else _llama_fields(values, architecture == MISTRAL)
    if architecture == MISTRAL:
        fields["sliding_window"] = _mistral_window(values)
    else:
        _refuse_ignored_window(values, GPT2_NAME if architecture == GPT2 else LLAMA_NAME)
        fields["sliding_window"] = None
    return fields


def _mistral_window(c: _Values) -> int | None:
    """A Mistral config.json's sliding_window: MistralConfig's default 4096 when the key is absent,
    none when it is null (Mistral 7B v0.2 and later attend over the whole context)."""
    if "sliding_window" not in c.config:
        return MISTRAL_DEFAULT_WINDOW
    window = c.integer("sliding_window", None)
    c.require(window is None or window >= 1, f"sliding_window is {window}; it must be a positive number of tokens "
              "(each attends to itself and the sliding_window - 1 before it), or null for none.")
    return window


def _refuse_ignored_window(c: _Values, architecture: str) -> None:
    """A window in the config.json of an architecture that has none: transformers ignores the key there,
    but the file says the weights were trained with it, and which is true cannot be told. Never dropped
    silently."""
    window, switched = c.config.get("sliding_window"), c.config.get("use_sliding_window")
    if window is None or switched is False:  # Qwen2-style configs hold a window they switched off
        return
    fix = ("If they were, the model is a Mistral: set architectures to [\"MistralForCausalLM\"] (llmtrain reads "
           "its window as model.sliding_window); if not, remove the sliding_window key." if architecture == LLAMA_NAME
           else "If they were not, remove the sliding_window key; a GPT-2 trained with a window has no Hugging Face "
           "layout llmtrain reads.")
    raise UnsupportedModel(
        f"{c.where}: sliding_window is {_shown(window)}, but {architecture} has no sliding-window attention "
        "(transformers ignores the key for it and attends over the whole context), so whether the weights were "
        f"trained with the window cannot be told, and llmtrain does not drop it silently. {fix}")


_REQUIRED = object()


class _Values:
    """config.json's values, each read as the type it must have (UnsupportedModel naming the key if not)."""

    def __init__(self, config: dict[str, Any], where: str) -> None:
        self.config, self.where = config, where

    def _get(self, key: str, default: Any) -> Any:
        value = self.config.get(key)
        if value is None:
            if default is _REQUIRED:
                raise UnsupportedModel(f"{self.where} lacks {key!r}, which this architecture's config.json holds; the "
                                       "file is damaged or incomplete: download or save the model again.")
            return default
        return value

    def _refuse(self, key: str, value: Any, expected: str) -> None:
        raise UnsupportedModel(f"{self.where}: {key} is {_shown(value)}; it must be {expected}. The file is damaged: "
                               "download or save the model again.")

    def integer(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)  # 12.0, as a hand-edited file may say
        if isinstance(value, bool) or not isinstance(value, int):
            self._refuse(key, value, "an integer")
        return value

    def number(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self._refuse(key, value, "a finite number")
        return float(value)

    def flag(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if not isinstance(value, bool):
            self._refuse(key, value, "true or false")
        return value

    def text(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if not isinstance(value, str):
            self._refuse(key, value, "a string")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        value = self._get(key, {})
        if not isinstance(value, dict):
            self._refuse(key, value, "an object (or null)")
        return value

    def require(self, ok: bool, what: str) -> None:
        if not ok:
            raise UnsupportedModel(f"{self.where}: {what}")


def _shown(value: Any) -> str:
    """A config.json value as it reads in the file, cut short."""
    text = json.dumps(value) if isinstance(value, (bool, str, list, dict)) or value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _gpt2_fields(c: _Values) -> dict[str, Any]:
    act = c.text("activation_function", "gelu_new")
    c.require(act in GPT2_ACTIVATIONS, f"activation_function is {act!r}; llmtrain's GELU is the tanh approximation "
              f"({' or '.join(GPT2_ACTIVATIONS)}), and another activation would change every logit.")
    for key, expected in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("reorder_and_upcast_attn", False)):
        c.require(c.flag(key, expected) == expected, f"{key} is {c.config.get(key)!r}; llmtrain's attention supports "
                  f"only {key}={expected}.")
    n_embd = c.integer("n_embd", 768)
    return {
        "n_layer": c.integer("n_layer", 12), "n_head": c.integer("n_head", 12), "n_kv_head": None,
        "n_embd": n_embd, "block_size": c.integer("n_positions", 1024), "vocab_size": c.integer("vocab_size", 50257),
        "intermediate_size": c.integer("n_inner", 4 * n_embd), "rope_theta": 10000.0,
        "norm_eps": c.number("layer_norm_epsilon", 1e-5), "bias": True,
        "tie_weights": c.flag("tie_word_embeddings", True), "position": PositionEncoding.learned,
        "norm": NormKind.layernorm, "mlp": MlpKind.gelu, "norm_position": NormPosition.pre,
    }


def rope_theta_of(c: _Values) -> float:
    """rope_theta, from transformers 4's top-level key or 5's rope_parameters; scaled RoPE is refused."""
    params, scaling = c.mapping("rope_parameters"), c.mapping("rope_scaling")
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    c.require(kind == "default", f"RoPE is scaled ({kind!r}); llmtrain implements unscaled RoPE only (rope_type "
              "'default').")
    if params.get("rope_theta") is not None:
        return _Values(params, f"{c.where} (rope_parameters)").number("rope_theta")
    return c.number("rope_theta", 10000.0)


def _llama_fields(c: _Values, mistral: bool = False) -> dict[str, Any]:
    """A Llama (or Mistral: the same tensors, no biases, other defaults) config.json's fields."""
    act = c.text("hidden_act", "silu")
    c.require(act == "silu", f"hidden_act is {act!r}; llmtrain's gated MLP is SwiGLU (hidden_act 'silu').")
    hidden, heads = c.integer("hidden_size"), c.integer("num_attention_heads")
    c.require(heads >= 1 and hidden % heads == 0,
              f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}.")
    head_dim = c.integer("head_dim", None)
    c.require(head_dim in (None, hidden // heads), f"head_dim is {head_dim}, not hidden_size / num_attention_heads = "
              f"{hidden // heads}; llmtrain's heads split the width evenly.")
    c.require(c.integer("pretraining_tp", 1) == 1,
              f"pretraining_tp is {c.config.get('pretraining_tp')}; only 1 (unsplit projections) is supported.")
    attention_bias, mlp_bias = c.flag("attention_bias", False), c.flag("mlp_bias", False)
    c.require(attention_bias == mlp_bias, f"attention_bias is {attention_bias} but mlp_bias is {mlp_bias}; llmtrain's "
              "model.bias switches both together.")
    c.require(not (mistral and attention_bias), "attention_bias and mlp_bias are true, but MistralForCausalLM's "
              "projections have no biases (transformers ignores the keys for it); remove them or set them to false.")
    kv = c.integer("num_key_value_heads", heads)
    return {
        "n_layer": c.integer("num_hidden_layers"), "n_head": heads, "n_kv_head": kv if kv != heads else None,
        "n_embd": hidden, "block_size": c.integer("max_position_embeddings", 131072 if mistral else 2048),
        "vocab_size": c.integer("vocab_size"), "intermediate_size": c.integer("intermediate_size"),
        "rope_theta": rope_theta_of(c), "norm_eps": c.number("rms_norm_eps", 1e-6), "bias": attention_bias,
        "tie_weights": c.flag("tie_word_embeddings", False), "position": PositionEncoding.rope,
        "norm": NormKind.rmsnorm, "mlp": MlpKind.swiglu, "norm_position": NormPosition.pre,
    }


# ---- llmtrain -> HF --------------------------------------------------------------------------------

GPT2_RECIPE = {"position": PositionEncoding.learned, "norm": NormKind.layernorm, "mlp": MlpKind.gelu}
LLAMA_RECIPE = {"position": PositionEncoding.rope, "norm": NormKind.rmsnorm, "mlp": MlpKind.swiglu}


def layout_of_model(cfg: ModelConfig) -> str:
    """GPT2 or LLAMA for an llmtrain model (LLAMA with model.sliding_window: written as a Mistral);
    UnsupportedModel says what differs from each."""
    differs = {}
    for layout, recipe in ((GPT2, GPT2_RECIPE), (LLAMA, LLAMA_RECIPE)):
        wrong = [f"model.{key}={getattr(cfg, key).value} (needs {value.value})" for key, value in recipe.items()
                 if getattr(cfg, key) is not value]
        if cfg.norm_position is not NormPosition.pre:
            wrong.append("model.norm_position=post (needs pre)")
        if layout == GPT2 and (cfg.n_kv_head or cfg.n_head) != cfg.n_head:
            wrong.append(f"model.n_kv_head={cfg.n_kv_head} (GPT-2 has one key/value head per query head)")
        if layout == GPT2 and cfg.sliding_window is not None:
            wrong.append(f"model.sliding_window={cfg.sliding_window} (GPT-2 has no sliding-window attention: needs "
                         "null)")
        if layout == LLAMA and cfg.sliding_window is not None and cfg.bias:
            wrong.append(f"model.bias=true (with model.sliding_window={cfg.sliding_window} it is a Mistral, whose "
                         "projections have no biases: needs false)")
        if not wrong:
            return layout
        differs[layout] = wrong
    raise UnsupportedModel(
        "this model has no Hugging Face equivalent: as GPT-2 it differs in " + ", ".join(differs[GPT2])
        + "; as Llama (Mistral with a sliding window) in " + ", ".join(differs[LLAMA]) + ". Export it in llmtrain's "
        "own format (`llmtrain export RUN_DIR`, the default), or train a model=gpt2-style (learned positions, "
        "LayerNorm, GELU, no sliding window) or Llama-style (RoPE, RMSNorm, SwiGLU; no biases with a sliding window) "
        "pre-norm model."
    )


def hf_config(cfg: ModelConfig, vocab_size: int, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """The config.json transformers builds this model from (GPT2LMHeadModel, LlamaForCausalLM, or
    MistralForCausalLM for a Llama-style model with model.sliding_window)."""
    from llmtrain.model import kv_heads, mlp_width, norm_eps

    common = {"vocab_size": vocab_size, "bos_token_id": bos_id, "eos_token_id": eos_id,
              "tie_word_embeddings": cfg.tie_weights, "torch_dtype": "float32", "use_cache": True}
    if layout_of_model(cfg) == GPT2:
        return {"architectures": ["GPT2LMHeadModel"], "model_type": GPT2, "n_layer": cfg.n_layer,
                "n_head": cfg.n_head, "n_embd": cfg.n_embd, "n_positions": cfg.block_size, "n_inner": mlp_width(cfg),
                "activation_function": "gelu_new", "layer_norm_epsilon": norm_eps(cfg),
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False, **common}
    # rope_theta at the top level (transformers 4) and in rope_parameters (transformers 5).
    llama = {"num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
             "num_key_value_heads": kv_heads(cfg), "hidden_size": cfg.n_embd, "head_dim": cfg.n_embd // cfg.n_head,
             "intermediate_size": mlp_width(cfg), "hidden_act": "silu", "max_position_embeddings": cfg.block_size,
             "rms_norm_eps": norm_eps(cfg), "rope_theta": cfg.rope_theta, "rope_scaling": None,
             "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
             "attention_dropout": cfg.dropout, **common}
    if cfg.sliding_window is not None:  # Mistral: Llama's tensors with the window (and, checked above, no biases)
        return {"architectures": [MISTRAL_NAME], "model_type": MISTRAL, **llama, "sliding_window": cfg.sliding_window}
    return {"architectures": [LLAMA_NAME], "model_type": LLAMA, **llama, "attention_bias": cfg.bias,
            "mlp_bias": cfg.bias, "pretraining_tp": 1}


# ---- tensors ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """One llmtrain tensor and the HF tensors it is made of: `ours` = cat(theirs, dim 0), each HF
    tensor transposed first when `transposed` (GPT-2's Conv1D stores weights as (in, out)).
    `optional`: llmtrain may lack it (a bias-free model exports zeros where HF has a bias)."""

    ours: str
    theirs: tuple[str, ...]
    transposed: bool = False
    optional: bool = False


def pieces(cfg: ModelConfig, layout: str) -> list[Piece]:
    """Every tensor of the layout, llmtrain name <- HF names (no lm_head when the head is tied)."""
    return list(_gpt2_pieces(cfg) if layout == GPT2 else _llama_pieces(cfg))


def _gpt2_pieces(cfg: ModelConfig) -> Iterator[Piece]:
    t = "transformer."
    yield Piece("wte.weight", (f"{t}wte.weight",))
    yield Piece("wpe.weight", (f"{t}wpe.weight",))
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"{t}h.{i}."
        for norm, ln in (("norm1", "ln_1"), ("norm2", "ln_2")):
            yield Piece(f"{ours}{norm}.weight", (f"{theirs}{ln}.weight",))
            yield Piece(f"{ours}{norm}.bias", (f"{theirs}{ln}.bias",), optional=True)
        for mine, conv in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.up", "mlp.c_fc"),
                           ("mlp.down", "mlp.c_proj")):
            yield Piece(f"{ours}{mine}.weight", (f"{theirs}{conv}.weight",), transposed=True)
            yield Piece(f"{ours}{mine}.bias", (f"{theirs}{conv}.bias",), optional=True)
    yield Piece("norm_f.weight", (f"{t}ln_f.weight",))
    yield Piece("norm_f.bias", (f"{t}ln_f.bias",), optional=True)
    if not cfg.tie_weights:
        yield Piece("lm_head.weight", ("lm_head.weight",))


def _llama_pieces(cfg: ModelConfig) -> Iterator[Piece]:
    m = "model."
    yield Piece("wte.weight", (f"{m}embed_tokens.weight",))
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"{m}layers.{i}."
        yield Piece(f"{ours}norm1.weight", (f"{theirs}input_layernorm.weight",))
        yield Piece(f"{ours}norm2.weight", (f"{theirs}post_attention_layernorm.weight",))
        projections = [("attn.qkv", tuple(f"{theirs}self_attn.{p}_proj" for p in "qkv")),
                       ("attn.proj", (f"{theirs}self_attn.o_proj",))]
        projections += [(f"mlp.{p}", (f"{theirs}mlp.{p}_proj",)) for p in ("gate", "up", "down")]
        for mine, names in projections:
            yield Piece(f"{ours}{mine}.weight", tuple(f"{n}.weight" for n in names))
            if cfg.bias:
                yield Piece(f"{ours}{mine}.bias", tuple(f"{n}.bias" for n in names))
    yield Piece("norm_f.weight", (f"{m}norm.weight",))
    if not cfg.tie_weights:
        yield Piece("lm_head.weight", ("lm_head.weight",))


def join(piece: Piece, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The llmtrain tensor from its HF tensors."""
    parts = [t.t() if piece.transposed else t for t in tensors]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def split(piece: Piece, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The HF tensors of an llmtrain tensor (`sizes`: their lengths along dim 0, as llmtrain holds them)."""
    parts = list(tensor.split(sizes, dim=0)) if len(sizes) > 1 else [tensor]
    return [p.t().contiguous() if piece.transposed else p.contiguous() for p in parts]


def split_sizes(cfg: ModelConfig, piece: Piece, tensor: torch.Tensor) -> list[int]:
    """How an llmtrain tensor divides into its HF tensors: q | k | v for a Llama q/k/v projection."""
    if len(piece.theirs) == 1:
        return [tensor.shape[0]]
    from llmtrain.model import kv_heads

    head_dim = cfg.n_embd // cfg.n_head
    return [cfg.n_head * head_dim, kv_heads(cfg) * head_dim, kv_heads(cfg) * head_dim]


def hf_state_dict(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An llmtrain state dict under HF's names and layouts (zeros for biases HF has and this model
    lacks; the tied head is left out, as transformers saves it)."""
    layout = layout_of_model(cfg)
    out: dict[str, torch.Tensor] = {}
    for piece in pieces(cfg, layout):
        tensor = state.get(piece.ours)
        if tensor is None:
            if not piece.optional:
                raise UnsupportedModel(f"the model has no {piece.ours}, which the {layout} layout needs")
            # a bias as long as its weight's output (rows, as llmtrain holds every weight)
            width = state[piece.ours.removesuffix(".bias") + ".weight"].shape[0]
            tensor = torch.zeros(width, dtype=state["wte.weight"].dtype)
        for name, part in zip(piece.theirs, split(piece, tensor, split_sizes(cfg, piece, tensor))):
            out[name] = part
    return out

