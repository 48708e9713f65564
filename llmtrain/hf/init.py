"""model.init_from=FOLDER: a config resolved against a local Hugging Face model folder.

`apply_init_from(cfg)` makes the config describe the folder's model before anything else runs:
its shape (every `layouts.SHAPE_FIELDS` key still at its `ModelConfig` default takes the
folder's value; one set to anything else must agree with it), its name, and its tokenizer
(data.tokenizer=pretrained, data.tokenizer_dir=FOLDER: the checkpoint's embedding rows are the
ids of the folder's tokenizer.json). The weights are checked too, from the safetensors headers
only (every tensor there, of the shape config.json implies, no file truncated), so a damaged
folder fails before the data is prepared; `training/setup.py` loads them into the fresh model.
Running it again on a resolved config changes nothing.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from llmtrain.config.schema import Config, DataConfig, ModelConfig, TokenizerKind
from llmtrain.config.validate import validate
from llmtrain.core.errors import ConfigError
from llmtrain.core.hf_files import CONFIG, TOKENIZER
from llmtrain.hf import layouts
from llmtrain.hf.folder import HFFolder, check_weights

KEY = "model.init_from"


def apply_init_from(cfg: Config, explicit: Collection[str] | None = None) -> None:
    """Resolve `cfg` against the folder model.init_from names (no-op when it is null); raises
    ConfigError naming every contradiction, or what the folder lacks.

    `explicit`: the config keys the user set (`model.n_layer`, `data.tokenizer`; `model` for a
    model group other than the default, which sets every shape key): each must agree with the
    folder, even when it equals its default. None (a Config built in code): every key that differs
    from its default counts as set. The config is validated before the weights are checked, so a
    bad value gets its own message first."""
    if cfg.model.init_from is None:
        return
    if not cfg.model.init_from.strip():
        raise ConfigError(f"{KEY} is empty; give a local Hugging Face model folder, e.g. {KEY}=models/gpt2, or null.")
    folder = open_folder(cfg.model.init_from)
    _resolve_model(cfg.model, folder, explicit)
    _resolve_tokenizer(cfg.data, folder, cfg.model.init_from, explicit)
    validate(cfg)
    _check_tokenizer_fits(cfg, folder)
    check_weights(folder, cfg.model)


def explicit_keys(overrides: Collection[str]) -> set[str]:
    """The config keys a command line's overrides set: `model.n_layer=4` -> model.n_layer; a model
    group other than the default (`model=gpt2`) -> model (it sets every shape key)."""
    keys: set[str] = set()
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key == "model" and value != ModelConfig().name:
            keys.add("model")
        elif key.startswith(("model.", "data.")):
            keys.add(key)
    return keys


def open_folder(location: str) -> HFFolder:
    """The folder, checked: config.json of a supported layout, readable weights, a tokenizer.json."""
    folder = HFFolder.open(location, KEY, need_weights=True)
    if not os.path.lexists(folder.path / TOKENIZER):  # a FIFO or folder there is named by its reader
        raise ConfigError(
            f"{KEY}={location} has no {TOKENIZER}; the folder is incomplete: the checkpoint's embedding rows are "
            "the ids of its own tokenizer, so llmtrain needs that file to prepare data and sample. Copy the model's "
            "tokenizer.json into the folder (it comes with the model, e.g. `hf download NAME --local-dir FOLDER`)."
        )
    return folder


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(getattr(value, "value", value))


def _effective(key: str, model: ModelConfig, value: Any) -> Any:
    """What a value means for the built model: null n_kv_head is n_head, null norm_eps and
    intermediate_size are the defaults model.py derives."""
    from llmtrain import model as gpt

    probe = dataclasses.replace(model, **{key: value})
    derived = {"n_kv_head": gpt.kv_heads, "norm_eps": gpt.norm_eps, "intermediate_size": gpt.mlp_width}
    return derived[key](probe) if key in derived else value


def _resolve_model(model: ModelConfig, folder: HFFolder, explicit: Collection[str] | None) -> None:
    fields, defaults = folder.model_fields(), ModelConfig()
    group = explicit is not None and "model" in explicit
    differs = []
    for key in layouts.SHAPE_FIELDS:
        ours, theirs = getattr(model, key), fields[key]
        decided = ours != getattr(defaults, key) if explicit is None else group or f"model.{key}" in explicit
        # A null vocab_size means "the data's": the folder's embedding decides; rope_theta means nothing
        # without RoPE.
        free = (key == "vocab_size" and ours is None) or (key == "rope_theta" and fields["position"].value == "learned")
        probe = dataclasses.replace(model, **{k: fields[k] for k in ("n_head", "n_embd", "mlp", "norm")})
        if decided and not free and _effective(key, probe, ours) != _effective(key, probe, theirs):
            differs.append(f"model.{key} is {_shown(ours)} but the folder has {_shown(theirs)}")
    if differs:
        source = (f" (model={model.name} sets them, or an override)"
                  if group or model.name not in (defaults.name, folder.name) else "")
        raise ConfigError(
            f"{KEY}={model.init_from}: the config contradicts the folder's {folder.path / CONFIG}: "
            f"{'; '.join(differs)}{source}. Keys left at their defaults take the folder's shape: drop these "
            "overrides, and pick the model group that matches the folder or none (the default takes any folder's "
            "shape)."
        )
    for key in layouts.SHAPE_FIELDS:
        setattr(model, key, fields[key])
    if model.name == defaults.name:
        model.name = folder.name


def _same_folder(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def _resolve_tokenizer(data: DataConfig, folder: HFFolder, init_from: str, explicit: Collection[str] | None) -> None:
    """data.tokenizer=pretrained from the folder; another tokenizer is refused: its ids would index
    embedding rows trained for other tokens. data.tokenizer_dir is stored resolved (absolute), so a
    resume from another working directory names the same folder."""
    chosen = explicit is not None and "data.tokenizer" in explicit
    if data.tokenizer is not TokenizerKind.pretrained and (chosen or data.tokenizer is not TokenizerKind.byte):
        raise ConfigError(
            f"data.tokenizer={data.tokenizer.value} cannot train a model from {KEY}={init_from}: the checkpoint's "
            "embedding rows mean the tokens of the folder's tokenizer.json, and another tokenizer's ids would "
            f"index rows trained for other tokens. Drop data.tokenizer ({KEY} uses the folder's tokenizer, "
            "data.tokenizer=pretrained)."
        )
    if data.tokenizer_dir is not None and not _same_folder(data.tokenizer_dir, init_from):
        raise ConfigError(
            f"data.tokenizer_dir={data.tokenizer_dir} but {KEY}={init_from}: the checkpoint's embedding rows mean "
            f"the tokens of {init_from}/{TOKENIZER}, not another folder's. Drop data.tokenizer_dir ({KEY} sets it)."
        )
    data.tokenizer = TokenizerKind.pretrained
    data.tokenizer_dir = str(Path(data.tokenizer_dir or init_from).expanduser().resolve())


def _check_tokenizer_fits(cfg: Config, folder: HFFolder) -> None:
    """The tokenizer reads (with an end-of-text token) and each of its ids has an embedding row."""
    from llmtrain.data.cache import pretrained_tokenizer

    tokenizer = pretrained_tokenizer(cfg.data)  # cached: prepare reads the same one
    rows = cfg.model.vocab_size
    if rows is not None and tokenizer.vocab_size > rows:
        raise ConfigError(
            f"{KEY}={cfg.model.init_from}: its {TOKENIZER} has {tokenizer.vocab_size:,} tokens, but "
            f"{folder.path / CONFIG} gives the model {rows:,} embedding rows (vocab_size), so ids from {rows:,} up "
            "would have none; the tokenizer and the weights do not belong together: download or save the folder again."
        )
