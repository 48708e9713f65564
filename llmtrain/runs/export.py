"""`llmtrain export <run dir>`: the trained weights as safetensors + the model config as JSON.

The export holds what inference needs and nothing of the training state (no optimizer, RNG or
data position): `model.safetensors`, `model_config.json` and `tokenizer.json`. `llmtrain sample`
reads an export folder as well as a run dir. `--format hf` writes a Hugging Face folder instead
(llmtrain/hf/export.py), which transformers loads with no llmtrain code. Both formats check their
folder and write it the same way (hf/export.py check_target, write_export): a previous export is
replaced whole, anything else there is refused untouched, and an interrupted export leaves no half
folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_model

from llmtrain.config.schema import config_to_dict
from llmtrain.core.errors import UserError
from llmtrain.core.files import TOKENIZER
from llmtrain.data.tokenizers import Tokenizer, save_tokenizer
from llmtrain.hf.export import check_target, export_hf, write_export
from llmtrain.model import GPT
from llmtrain.runs.artifacts import MODEL_CONFIG, WEIGHTS, load_run


def export_model(model: GPT, tokenizer: Tokenizer, context: int, out_dir: Path,
                 tokenizer_file: Path | None = None) -> Path:
    """Write `model`'s weights, its config and its tokenizer into `out_dir`: a copy of the run's
    `tokenizer_file`, else (a Hugging Face folder's tokenizer) `tokenizer` saved in llmtrain's form.
    The folder is checked and written as an HF export's is (hf/export.py): replaced whole if it holds
    a previous export, refused if it holds anything else, never left half written."""
    target = check_target(out_dir)
    meta = {"model": config_to_dict(model.cfg), "vocab_size": model.vocab_size, "context": context}

    def fill(folder: Path) -> None:
        # save_model de-duplicates tied tensors (safetensors refuses shared storage) and load_model re-ties them.
        save_model(model, str(folder / WEIGHTS), metadata={"format": "llmtrain-1"})
        (folder / MODEL_CONFIG).write_text(json.dumps(meta, indent=2))
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, folder / TOKENIZER)
        else:
            save_tokenizer(tokenizer, folder / TOKENIZER)

    write_export(target, fill)
    return out_dir


FORMATS = ("llmtrain", "hf")
# Default folders under the run dir, one per format, so exporting both keeps both.
DEFAULT_OUT = {"llmtrain": "export", "hf": "export-hf"}


@torch.no_grad()
def export_run(run_dir: Path, out_dir: Path | None = None, fmt: str = "llmtrain") -> Path:
    """Export a run dir (or re-export an export folder) into `out_dir`, by default RUN_DIR/export
    (format llmtrain) or RUN_DIR/export-hf (format hf)."""
    if fmt not in FORMATS:
        raise UserError(f"--format is {fmt!r}; valid formats: {', '.join(FORMATS)}.")
    target = out_dir or Path(run_dir) / DEFAULT_OUT[fmt]
    check_target(target)  # before the model is loaded: a folder that will be refused costs nothing
    run = load_run(run_dir)
    if fmt == "hf":
        export_hf(run.model, run.tokenizer.to_dict(), run.context, target)
        return target
    return export_model(run.model, run.tokenizer, run.context, target, run.tokenizer_file)
