"""A LoRA run's frozen base: the model.init_from folder that its adapter-only checkpoints and
model.pt sit on (config/finetune.py adapter_checkpoints).

`base_identity` is the folder's path and a sha256 of its safetensors files (each file's name, size
and every byte), computed once when a process starts on the folder, never at a save;
`check_same_base` refuses, in one paragraph, a base whose identity is not the recorded one (a
resume, and every reader of the run's weights); `base_weights` are the folder's weights under
llmtrain's names, which runs/artifacts.py puts under the adapters before merging them. `run_base`
is the record a run keeps (lora_base.json, each checkpoint's trainer_state.json): the identity, and
under finetune=qlora how the base was quantized (`quantized`), which readers dequantize it by.

Why every byte, not (name, size, mtime) or a sample: the adapters are a correction to exactly these
weights, and an edit that keeps a file's size (a re-quantized, re-saved or fine-tuned base in
place) would pass a size check, a sampled one could miss it, while an mtime changes on a plain copy
(`cp`, a re-download of the same files) and would refuse a base that is the same. Hashing reads the
files once, as loading them does anyway (sha256 runs at about 1 GB/s on one core: a 135M-parameter
base in under a second, a 7B one in about 15 s), at the start of a run or of a reader, so it costs
what loading the base costs and nothing per checkpoint.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from llmtrain.config.schema import ModelConfig
from llmtrain.core.errors import ConfigError
from llmtrain.hf.folder import HFFolder, load_weights

# trainer_state.json's key for the identity in a checkpoint; the run dir keeps it as core/files.py LORA_BASE.
BASE_RECORD = "lora_base"


def base_identity(location: str | Path) -> dict[str, Any]:
    """{"path", "sha256", "files", "bytes"} of a Hugging Face folder's weights (ConfigError, naming
    the folder, when it cannot be opened or read)."""
    folder = HFFolder.open(str(location), need_weights=True)
    digest = hashlib.sha256()
    files = sorted(set(folder.weight_files.values()))
    total = 0
    try:
        for file in files:
            size = file.stat().st_size
            digest.update(f"{file.name}\0{size}\0".encode())
            with open(file, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 24), b""):
                    digest.update(chunk)
            total += size
    except OSError as err:
        raise ConfigError(f"the base model's weights in {folder.path} cannot be read ({err})") from None
    return {"path": str(folder.path), "sha256": digest.hexdigest(), "files": [f.name for f in files], "bytes": total}


def run_base(cfg: Any) -> dict[str, Any] | None:
    """The base record of a run whose checkpoints hold adapters alone (None for any other run): the
    folder's identity, and under finetune=qlora the NF4 quantization its weights are stored in (the
    adapters correct the quantized weights, not the folder's)."""
    from llmtrain.config.finetune import adapter_checkpoints, quantized_base

    if not adapter_checkpoints(cfg):
        return None
    record = base_identity(cfg.model.init_from)
    if quantized_base(cfg):
        from llmtrain.qlora import NF4_RECORD

        record["quantized"] = dict(NF4_RECORD)
    return record


def describe(identity: dict[str, Any]) -> str:
    files = identity.get("files") or []
    return (f"{identity.get('path')} (sha256 {str(identity.get('sha256'))[:16]}... of {len(files)} safetensors "
            f"file{'s' if len(files) != 1 else ''}, {identity.get('bytes', 0):,} bytes)")


def same_base(recorded: Any, current: dict[str, Any]) -> bool:
    """The same weights, wherever the folder now is: a moved copy is the same base."""
    return isinstance(recorded, dict) and recorded.get("sha256") == current["sha256"]


def check_same_base(recorded: Any, current: dict[str, Any], what: str, fix: str) -> None:
    """ConfigError in one paragraph when `current` (the folder's identity now) is not `recorded`."""
    if same_base(recorded, current):
        return
    was = describe(recorded) if isinstance(recorded, dict) else "not recorded (the record is damaged)"
    raise ConfigError(
        f"{what}: the base model's weights are not the ones its LoRA adapters were trained on. The adapters were "
        f"trained on {was}; the folder now is {describe(current)}. Adapters are a correction to exactly those "
        f"weights and mean nothing on others. {fix}"
    )


def base_weights(location: str | Path) -> dict[str, torch.Tensor]:
    """The folder's weights as an llmtrain state dict (the model its config.json describes, built
    without random init)."""
    from llmtrain.model import GPT, uninitialized

    folder = HFFolder.open(str(location), need_weights=True)
    fields = folder.model_fields()
    with uninitialized():
        model = GPT(ModelConfig(name=folder.name, **fields), fields["vocab_size"])
    load_weights(model, folder)
    return model.state_dict()
