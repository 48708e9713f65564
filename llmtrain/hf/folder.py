"""A local Hugging Face model folder: what it holds, and its weights loaded into an llmtrain model.

`HFFolder.open(path, key)` checks the folder before any work (it exists, is not a Hub name, has a
readable config.json of a supported layout, safetensors weights whole or as a sharded index, a
tokenizer.json) and names what is missing or damaged. `load_weights(model, folder)` fills an
llmtrain `GPT` built with the folder's shape, one tensor at a time straight from the safetensors
files (memory-mapped), so the host holds the model plus one tensor, never a second state dict.
Nothing here downloads: a name that is not a folder gets the command that would download it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmtrain.config.schema import ModelConfig
from llmtrain.core.errors import ConfigError
from llmtrain.core.hf_files import (
    CONFIG,
    WEIGHTS,
    WEIGHTS_INDEX,
    folder_path,
    read_config,
    special_ids,
)
from llmtrain.core.readers import UnreadableFile, read_json, regular_file_problem
from llmtrain.hf import layouts


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
        return special_ids(self.path, self.config)


def weight_index(path: Path, key: str) -> dict[str, Path]:
    """HF tensor name -> its safetensors file: model.safetensors, or the shards a
    model.safetensors.index.json lists (every shard a regular file inside the folder)."""
    from safetensors import safe_open

    single, index = path / WEIGHTS, path / WEIGHTS_INDEX
    if os.path.lexists(index):
        return _shards(path, index, key)
    if os.path.lexists(single):
        _require_weights_file(single)
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


def _shards(path: Path, index: Path, key: str) -> dict[str, Path]:
    """The index's weight_map, checked: tensor names to shard file names, each a plain name of a
    regular file in the folder itself (an index naming ../other/model.safetensors or /dev/zero
    would make llmtrain read what the folder does not hold)."""
    damaged = f"{index} is not a safetensors index: download or save the folder again"
    try:
        document = read_json(index, "the safetensors index")
    except UnreadableFile as err:
        raise ConfigError(f"{err} The folder is damaged: download or save it again.") from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{damaged} (it needs a \"weight_map\" object of tensor name -> shard file name).")
    odd = [f"{name!r}: {_short(shard)}" for name, shard in weight_map.items()
           if not isinstance(shard, str) or not shard or Path(shard).name != shard or shard in (".", "..")]
    if odd:
        raise ConfigError(f"{damaged}: its weight_map must name shard files of this folder by their plain names, "
                          f"but has {', '.join(odd[:3])}.")
    shards = {shard: path / shard for shard in set(weight_map.values())}
    missing = sorted(shard for shard, file in shards.items() if not os.path.lexists(file))
    if missing:
        raise ConfigError(f"{key}={path}: {index.name} lists shards that are not there: {', '.join(missing[:5])}.")
    for file in shards.values():
        _require_weights_file(file)
    return {name: shards[shard] for name, shard in weight_map.items()}


def _require_weights_file(file: Path) -> None:
    problem = regular_file_problem(file)
    if problem is not None:  # a FIFO would block forever, a device never end
        raise ConfigError(f"{file} (model weights) {problem}; the folder is damaged: download or save it again.")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# Floating-point safetensors dtypes: weights stored as integers or booleans are not a model's.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# Tensors a folder may hold that a model does not use: GPT-2's causal-mask buffers and Llama's RoPE
# frequencies (saved by older transformers versions), and a tied head saved beside its embedding.
IGNORED = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")
LAYER = {
    layouts.GPT2: re.compile(r"^(?:transformer\.)?h\.(\d+)\."),
    layouts.LLAMA: re.compile(r"^model\.layers\.(\d+)\."),
}


def check_weights(folder: HFFolder, model: ModelConfig) -> None:
    """The safetensors files hold exactly the model `model` describes (the folder's config.json):
    its number of layers, every tensor it needs with the shape it implies, floating point, and no
    tensor it would not use; read from the headers only (no tensor data), before any work. The
    layer count is compared first, so a config.json of a billion layers is refused before anything
    of its size is listed."""
    from safetensors import safe_open

    from llmtrain.model_tensors import layers_text, model_tensors, stored_layers

    headers: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in sorted(set(folder.weight_files.values())):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    piece = handle.get_slice(name)
                    headers[name] = (tuple(piece.get_shape()), piece.get_dtype())
        except Exception as err:  # safetensors' own error types: a truncated file or a damaged header
            raise ConfigError(f"{file} is not a readable safetensors file ({type(err).__name__}: {str(err)[:200]}); "
                              "the folder is damaged: download or save it again.") from None
    where = f"{folder.key}={folder.path}"
    held = stored_layers([n for n in headers if not IGNORED.search(n)], LAYER[folder.layout])
    if held != model.n_layer:
        raise ConfigError(f"{where}: {CONFIG} describes {layers_text(model.n_layer)}, but the weights hold {held:,}; "
                          "config.json and the weights do not belong together: download or save the folder again.")
    not_float = [f"{name} ({dtype})" for name, (_, dtype) in headers.items() if dtype not in FLOAT_DTYPES]
    if not_float:
        raise ConfigError(f"{where}: the weights store {', '.join(not_float[:3])} as integers or booleans, not "
                          f"floating point ({', '.join(FLOAT_DTYPES)}); they are not model weights: the folder is "
                          "damaged.")
    assert model.vocab_size is not None  # set from config.json
    tensors = model_tensors(model, model.vocab_size)
    expected = dict(tensors.items())
    pieces = layouts.pieces(model, folder.layout)
    shapes = {name: shape for name, (shape, _) in headers.items()}
    for piece in pieces:
        _check_piece(folder, piece, shapes, expected)
    # A model built uninitialized() for the folder keeps garbage in any tensor no piece fills: none may be left.
    left = sorted(set(expected) - {p.ours for p in pieces} - ({"lm_head.weight"} if model.tie_weights else set()))
    if left:
        raise ConfigError(f"{where}: the {folder.layout} layout does not fill {', '.join(left[:3])} of this model; it "
                          "cannot start from the folder's weights.")
    used = {_stored_name(folder, name) for piece in pieces for name in piece.theirs}
    tied_head = {"lm_head.weight"} if model.tie_weights else set()
    unused = sorted(n for n in headers if n not in used and n not in tied_head and not IGNORED.search(n))
    if unused:
        raise ConfigError(f"{where}: the weights hold {len(unused)} tensor(s) the model of its {CONFIG} does not use "
                          f"({', '.join(unused[:3])}); config.json and the weights do not belong together, and "
                          "training would silently drop them: download or save the folder again.")


def _check_piece(folder: HFFolder, piece: layouts.Piece, shapes: dict[str, tuple[int, ...]],
                 expected: dict[str, tuple[int, ...]]) -> None:
    names = [n if n in shapes else n.removeprefix("transformer.") for n in piece.theirs]
    missing = [theirs for theirs, name in zip(piece.theirs, names) if name not in shapes]
    if missing:
        raise ConfigError(f"{folder.key}={folder.path}: the weights lack {', '.join(missing[:3])}, which a "
                          f"{folder.layout} model of this config.json has; the folder is incomplete or damaged.")
    parts = [shapes[name][::-1] if piece.transposed else shapes[name] for name in names]
    joined = (parts[0] if len(parts) == 1
              else (sum(p[0] for p in parts), *parts[0][1:]) if len({p[1:] for p in parts}) == 1 else None)
    want = expected[piece.ours]
    if joined != want:
        raise ConfigError(f"{folder.key}={folder.path}: {' + '.join(piece.theirs)} has shape "
                          f"{' + '.join(str(p) for p in parts)}, but its config.json makes {piece.ours} {want}; the "
                          "weights and config.json do not belong together.")


@torch.no_grad()
def load_weights(model: torch.nn.Module, folder: HFFolder,
                 store: Callable[[str, torch.Tensor], bool] | None = None) -> None:
    """Copy the folder's weights into `model` (an llmtrain GPT of the folder's shape), tensor by
    tensor; every llmtrain tensor must be filled, with the shape it has, or ConfigError says which.

    `store`, where given, sees each tensor first (llmtrain's name, the value checked and in the
    model tensor's dtype) and returns True where it kept the value itself, which is then not copied:
    QLoRA quantizes its base weights straight from the file, so their full-precision copies are
    never held at once."""
    cfg = model.cfg
    params = model.state_dict()  # references to the live tensors (tied weights appear under both names)
    for piece in layouts.pieces(cfg, folder.layout):
        names = [_stored_name(folder, name) for name in piece.theirs]
        if any(n is None for n in names):
            missing = [t for t, n in zip(piece.theirs, names) if n is None]
            raise ConfigError(f"{folder.key}={folder.path}: the weights lack {', '.join(missing[:3])}, which a "
                              f"{folder.layout} model of this config.json has; the folder is incomplete or "
                              "damaged.")
        value = _read_piece(folder, piece, names)
        target = params[piece.ours]
        if value.shape != target.shape:
            raise ConfigError(f"{folder.key}={folder.path}: {' + '.join(piece.theirs)} has shape "
                              f"{tuple(value.shape)}, but its config.json makes {piece.ours} "
                              f"{tuple(target.shape)}; "
                              "the weights and config.json do not belong together.")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ConfigError(f"{folder.key}={folder.path}: {' + '.join(piece.theirs)} holds NaN or infinite "
                              "values; a model cannot start from them: the folder is damaged or the model it "
                              "was saved from had diverged.")
        # Outside the read's error handling: a failure here (quantizing, the device's memory) is
        # not the folder's, and shows as what it is.
        if store is None or not store(piece.ours, value.to(target.dtype)):
            target.copy_(value)
        del value


def _read_piece(folder: HFFolder, piece: layouts.Piece, names: list[str]) -> torch.Tensor:
    """The folder's tensors `names` joined into the llmtrain tensor `piece` makes of them; a file
    that fails to read (truncated, corrupt: safetensors fails on first read) is a ConfigError."""
    from safetensors import safe_open

    try:
        tensors = []
        for name in names:
            # One handle per tensor: safetensors memory-maps the file, and the mapped pages count
            # in the process's memory until the handle closes; held for the whole load they
            # would double the peak (2.0x the weights for GPT-2 124M, 1.3x this way).
            with safe_open(str(folder.weight_files[name]), framework="pt") as handle:
                tensors.append(handle.get_tensor(name))
        return layouts.join(piece, tensors)
    except Exception as err:
        raise ConfigError(f"{folder.key}={folder.path}: reading the weights failed ({type(err).__name__}: "
                          f"{str(err)[:200]}); the folder is damaged: download or save it again.") from None


def _stored_name(folder: HFFolder, name: str) -> str | None:
    """The name a tensor has in this folder: GPT-2 files saved from GPT2Model (OpenAI's originals)
    have no 'transformer.' prefix."""
    if name in folder.weight_files:
        return name
    bare = name.removeprefix("transformer.")
    return bare if bare in folder.weight_files else None
