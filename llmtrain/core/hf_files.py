"""A Hugging Face model folder's file names, the folder a setting names, its config.json read safely,
and the special token ids it declares: what both the tokenizer loader and the weight loader read."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from llmtrain.core.errors import ConfigError
from llmtrain.core.readers import UnreadableFile, read_json, regular_file_problem

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def folder_path(location: str, key: str) -> Path:
    """The folder `location` names; a Hub name (org/model) or a missing folder is refused with how to get it."""
    path = Path(location).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ConfigError(f"{key}={location} is a file; give the folder that holds config.json, the .safetensors "
                          "weights and tokenizer.json (as transformers' save_pretrained writes it).")
    if _HUB_NAME.match(location) and not location.startswith((".", "/", "~")):
        raise ConfigError(
            f"{key}={location} is not a folder on this machine; llmtrain never downloads. If it is a Hugging Face "
            f"Hub name, download it once with the Hugging Face CLI: `hf download {location} --local-dir "
            f"models/{location.split('/')[-1]}` (older versions: `huggingface-cli download ...`), then give "
            f"{key}=models/{location.split('/')[-1]}."
        )
    raise ConfigError(f"{key}={location}: no such folder; give a local Hugging Face model folder (config.json, "
                      "model.safetensors, tokenizer.json).")


def read_config(path: Path, key: str) -> dict[str, Any]:
    file = path / CONFIG
    if not file.is_file() and regular_file_problem(file) == "does not exist":
        raise ConfigError(f"{key}={path} has no {CONFIG}; a Hugging Face model folder holds config.json (the "
                          "architecture and shape), the .safetensors weights and tokenizer.json.")
    try:
        config = read_json(file, "the model's config")
    except UnreadableFile as err:
        raise ConfigError(f"{err} The folder is damaged: download or save it again.") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file} holds a JSON {type(config).__name__}, not an object; the folder is damaged.")
    return config


def special_ids(path: Path, config: dict[str, Any]) -> tuple[int | None, int | None]:
    """(bos, eos) token ids as config.json (or generation_config.json) gives them."""
    ids = dict(config)
    generation = path / GENERATION_CONFIG
    if os.path.lexists(generation):
        try:
            extra = read_json(generation, "the generation config")
            if isinstance(extra, dict):
                ids = {**extra, **{k: v for k, v in ids.items() if v is not None}}
        except UnreadableFile:
            pass  # optional file: config.json's ids stand
    return _first_id(ids.get("bos_token_id")), _first_id(ids.get("eos_token_id"))


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):  # Llama 3 lists several end tokens; the first ends documents here
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
