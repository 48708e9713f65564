"""A local Hugging Face model folder: what it holds, and its weights loaded into an llmtrain model.

`HFFolder.open(path, key)` checks the folder before any work (it exists, is not a Hub name, has a
readable config.json of a supported layout, safetensors weights whole or as a sharded index, a
tokenizer.json) and names what is missing or damaged. `load_weights(model, folder)` fills an
llmtrain `GPT` built with the folder's shape, one tensor at a time straight from the safetensors
files (memory-mapped), so the host holds the model plus one tensor, never a second state dict.
Nothing here downloads: a name that is not a folder gets the command that would download it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmtrain.errors import ConfigError
from llmtrain.hf import layouts

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class HFFolder:
    path: Path
    key: str  # the config key that named it (model.init_from, data.tokenizer_dir), for errors
    config: dict[str, Any]
    layout: str  # layouts.GPT2 or layouts.LLAMA
    weight_files: dict[str, Path]  # HF tensor name -> the safetensors file that holds it

    @classmethod
    def open(cls, location: str, key: str = "model.init_from", need_weights: bool = True) -> HFFolder:
        path = folder_path(location, key)
        config = read_config(path, key)
        layout = layouts.layout_of_config(config, f"{key}={location}: {path / CONFIG}")
        weight_files = weight_index(path, key) if need_weights else {}
        return cls(path, key, config, layout, weight_files)

    def model_fields(self) -> dict[str, Any]:
        return layouts.model_fields(self.config, f"{self.key}={self.path}: {self.path / CONFIG}")

    @property
    def name(self) -> str:
        """A label for the banner: the folder's name (e.g. SmolLM-135M)."""
        return self.path.name or str(self.path)

    def special_ids(self) -> tuple[int | None, int | None]:
        """(bos, eos) token ids as config.json (or generation_config.json) gives them."""
        ids = dict(self.config)
        generation = self.path / GENERATION_CONFIG
        if generation.is_file():
            try:
                ids = {**json.loads(generation.read_text()), **{k: v for k, v in ids.items() if v is not None}}
            except (OSError, ValueError):
                pass  # optional file: config.json's ids stand
        return _first_id(ids.get("bos_token_id")), _first_id(ids.get("eos_token_id"))


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):  # Llama 3 lists several end tokens; the first ends documents here
        value = value[0] if value else None
    return int(value) if isinstance(value, int) else None


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
    if not file.is_file():
        raise ConfigError(f"{key}={path} has no {CONFIG}; a Hugging Face model folder holds config.json (the "
                          "architecture and shape), the .safetensors weights and tokenizer.json.")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{file} is not readable JSON ({type(err).__name__}: {err}); the folder is damaged: "
                          "download or save it again.") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file} holds a JSON {type(config).__name__}, not an object; the folder is damaged.")
    return config


def weight_index(path: Path, key: str) -> dict[str, Path]:
    """HF tensor name -> its safetensors file: model.safetensors, or the shards a
    model.safetensors.index.json lists (every shard must be there)."""
    from safetensors import safe_open

    single, index = path / WEIGHTS, path / WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{index} is not a readable safetensors index ({type(err).__name__}); the folder is "
                              "damaged: download or save it again.") from None
        files = {name: path / shard for name, shard in weight_map.items()}
        missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if missing:
            raise ConfigError(f"{key}={path}: {index.name} lists shards that are not there: {', '.join(missing[:5])}.")
        return files
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt") as handle:
                return {name: single for name in handle.keys()}
        except Exception as err:  # safetensors raises its own error types for a damaged header
            raise ConfigError(f"{single} is not a readable safetensors file ({type(err).__name__}: {err}); the "
                              "folder is damaged: download or save it again.") from None
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    hint = (f" It has {', '.join(others[:3])}: pickled weights, which llmtrain does not load (they can run code); "
            "convert them once with transformers: `AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, "
            "safe_serialization=True)`." if others else "")
    raise ConfigError(f"{key}={path} has no weights: neither {WEIGHTS} nor {WEIGHTS_INDEX}.{hint}")


@torch.no_grad()
def load_weights(model: torch.nn.Module, folder: HFFolder) -> None:
    """Copy the folder's weights into `model` (an llmtrain GPT of the folder's shape), tensor by
    tensor; every llmtrain tensor must be filled, with the shape it has, or ConfigError says which."""
    from safetensors import safe_open

    cfg = model.cfg
    params = model.state_dict()  # references to the live tensors (tied weights appear under both names)
    try:
        for piece in layouts.pieces(cfg, folder.layout):
            names = [_stored_name(folder, name) for name in piece.theirs]
            if any(n is None for n in names):
                missing = [t for t, n in zip(piece.theirs, names) if n is None]
                raise ConfigError(f"{folder.key}={folder.path}: the weights lack {', '.join(missing[:3])}, which a "
                                  f"{folder.layout} model of this config.json has; the folder is incomplete or damaged.")
            tensors = []
            for name in names:
                # One handle per tensor: safetensors memory-maps the file, and the mapped pages count
                # in the process's memory until the handle closes; held for the whole load they
                # would double the peak (2.0x the weights for GPT-2 124M, 1.3x this way).
                with safe_open(str(folder.weight_files[name]), framework="pt") as handle:
                    tensors.append(handle.get_tensor(name))
            value = layouts.join(piece, tensors)
            target = params[piece.ours]
            if value.shape != target.shape:
                raise ConfigError(f"{folder.key}={folder.path}: {' + '.join(piece.theirs)} has shape "
                                  f"{tuple(value.shape)}, but its config.json makes {piece.ours} {tuple(target.shape)}; "
                                  "the weights and config.json do not belong together.")
            target.copy_(value)
            del tensors, value
    except ConfigError:
        raise
    except Exception as err:  # a truncated or corrupt safetensors file fails on first read
        raise ConfigError(f"{folder.key}={folder.path}: reading the weights failed ({type(err).__name__}: "
                          f"{str(err)[:200]}); the folder is damaged: download or save it again.") from None


def _stored_name(folder: HFFolder, name: str) -> str | None:
    """The name a tensor has in this folder: GPT-2 files saved from GPT2Model (OpenAI's originals)
    have no 'transformer.' prefix."""
    if name in folder.weight_files:
        return name
    bare = name.removeprefix("transformer.")
    return bare if bare in folder.weight_files else None
