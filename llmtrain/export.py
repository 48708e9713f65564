"""`llmtrain export <run dir>`: the trained weights as safetensors + the model config as JSON.

The export holds what inference needs and nothing of the training state (no optimizer, RNG or
data position): `model.safetensors`, `model_config.json` and `tokenizer.json`. `llmtrain sample`
reads an export folder as well as a run dir.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from llmtrain.checkpoint import MANIFEST, find_good_checkpoint, read_model_weights
from llmtrain.config import config_to_dict, model_config_from_dict
from llmtrain.errors import UserError
from llmtrain.model import GPT

WEIGHTS = "model.safetensors"
MODEL_CONFIG = "model_config.json"


def newest_weights(run_dir: Path, warn: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """The newest weights of a run (a CPU state_dict): model.pt of a finished run, unless a
    checkpoint is newer (a run extended and interrupted later), else its newest good checkpoint's
    (an interrupted run), whole even when the checkpoint is sharded."""
    warn = warn or (lambda message: print(f"llmtrain: warning: {message}", file=sys.stderr))
    final = run_dir / "model.pt"
    checkpoint = find_good_checkpoint(run_dir, warn)
    if final.is_file() and (checkpoint is None or final.stat().st_mtime >= (checkpoint / MANIFEST).stat().st_mtime):
        return torch.load(final, map_location="cpu", weights_only=True)
    if checkpoint is None:
        raise UserError(
            f"'{run_dir}' has no weights: neither model.pt (a finished run) nor a usable checkpoint "
            "under checkpoints/. Give a run directory that `llmtrain train` wrote."
        )
    return read_model_weights(checkpoint)


def export_model(model: GPT, tokenizer_file: Path, context: int, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    # save_model de-duplicates tied tensors (safetensors refuses shared storage) and load_model re-ties them.
    save_model(model, str(out_dir / WEIGHTS), metadata={"format": "llmtrain-1"})
    meta = {"model": config_to_dict(model.cfg), "vocab_size": model.vocab_size, "context": context}
    (out_dir / MODEL_CONFIG).write_text(json.dumps(meta, indent=2))
    shutil.copy(tokenizer_file, out_dir / "tokenizer.json")
    return out_dir


def load_exported(export_dir: Path, device: str = "cpu") -> tuple[GPT, int]:
    """(model in eval mode, training context) from an export folder."""
    meta = json.loads((export_dir / MODEL_CONFIG).read_text())
    model_cfg = model_config_from_dict(meta["model"])
    model = GPT(model_cfg, int(meta["vocab_size"]))
    load_model(model, str(export_dir / WEIGHTS), device=device)
    return model.to(device).eval(), int(meta["context"])


def is_export(path: Path) -> bool:
    return (path / WEIGHTS).is_file() and (path / MODEL_CONFIG).is_file()


@torch.no_grad()
def export_run(run_dir: Path, out_dir: Path | None = None) -> Path:
    from llmtrain.sample import load_run

    run = load_run(run_dir)
    target = out_dir or Path(run_dir) / "export"
    return export_model(run.model, Path(run_dir) / "tokenizer.json", run.context, target)
