"""`llmtrain export <run dir>`: the trained weights as safetensors + the model config as JSON.

The export holds what inference needs and nothing of the training state (no optimizer, RNG or
data position): `model.safetensors`, `model_config.json` and `tokenizer.json`. `llmtrain sample`
reads an export folder as well as a run dir.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_model

from llmtrain.config.schema import config_to_dict
from llmtrain.model import GPT
from llmtrain.runs.artifacts import MODEL_CONFIG, WEIGHTS, load_run
from llmtrain.runs.files import TOKENIZER


def export_model(model: GPT, tokenizer_file: Path, context: int, out_dir: Path) -> Path:
    """Write `model`'s weights, its config and a copy of `tokenizer_file` into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # save_model de-duplicates tied tensors (safetensors refuses shared storage) and load_model re-ties them.
    save_model(model, str(out_dir / WEIGHTS), metadata={"format": "llmtrain-1"})
    meta = {"model": config_to_dict(model.cfg), "vocab_size": model.vocab_size, "context": context}
    (out_dir / MODEL_CONFIG).write_text(json.dumps(meta, indent=2))
    shutil.copy(tokenizer_file, out_dir / TOKENIZER)
    return out_dir


@torch.no_grad()
def export_run(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Export a run dir (or re-export an export folder) into `out_dir`, by default RUN_DIR/export."""
    run = load_run(run_dir)
    target = out_dir or Path(run_dir) / "export"
    return export_model(run.model, Path(run_dir) / TOKENIZER, run.context, target)
