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

from llmtrain.config.derived import seq_len_of
from llmtrain.config.schema import config_to_dict
from llmtrain.core.errors import UserError
from llmtrain.core.files import CONFIG, TOKENIZER
from llmtrain.data.tokenizers import Tokenizer, load_tokenizer, save_tokenizer
from llmtrain.hf.export import check_target, export_hf, write_export
from llmtrain.model import GPT
from llmtrain.runs.artifacts import MODEL_CONFIG, WEIGHTS, load_run, newest_adapters, run_config


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


FORMATS = ("llmtrain", "hf", "peft")
# Default folders under the run dir, one per format, so exporting all keeps all.
DEFAULT_OUT = {"llmtrain": "export", "hf": "export-hf", "peft": "export-peft"}


@torch.no_grad()
def export_run(run_dir: Path, out_dir: Path | None = None, fmt: str = "llmtrain") -> Path:
    """Export a run dir (or re-export an export folder) into `out_dir`, by default RUN_DIR/export
    (format llmtrain), RUN_DIR/export-hf (format hf) or RUN_DIR/export-peft (format peft: a LoRA
    run's adapters)."""
    if fmt not in FORMATS:
        raise UserError(f"--format is {fmt!r}; valid formats: {', '.join(FORMATS)}.")
    target = out_dir or Path(run_dir) / DEFAULT_OUT[fmt]
    check_target(target)  # before the model is loaded: a folder that will be refused costs nothing
    if fmt == "peft":
        return export_adapters(Path(run_dir), target)
    run = load_run(run_dir)
    if fmt == "hf":
        export_hf(run.model, run.tokenizer.to_dict(), run.context, target)
        return target
    return export_model(run.model, run.tokenizer, run.context, target, run.tokenizer_file)


def export_adapters(run_dir: Path, target: Path) -> Path:
    """`--format peft`: a LoRA run's adapters (unmerged) for its model.init_from base, as peft
    writes them (hf/peft_export.py); anything else refused in one paragraph before any work."""
    from llmtrain.config.finetune import is_lora
    from llmtrain.hf.peft_export import export_peft

    if not (run_dir / CONFIG).is_file():
        raise UserError(f"--format peft exports the LoRA adapters of a run directory, and '{run_dir}' is not one (no "
                        f"{CONFIG}): an export or a Hugging Face folder holds a whole model, with no adapters apart. "
                        "Give the run directory `llmtrain train finetune=lora` wrote.")
    cfg = run_config(run_dir)
    if not is_lora(cfg):
        raise UserError(f"--format peft exports LoRA adapters, and '{run_dir}' is a full fine-tune "
                        "(finetune.method=full): every weight trained, there are no adapters. `llmtrain export "
                        f"{run_dir} --format hf` writes its whole model for transformers.")
    if cfg.model.init_from is None:
        raise UserError(f"--format peft needs the base model as a Hugging Face folder for the adapters to go on, and "
                        f"'{run_dir}' trained LoRA on a randomly initialized model (no model.init_from) that exists "
                        f"only in this run's weights. `llmtrain export {run_dir} --format hf` writes the merged "
                        "model, base and adapters together.")
    adapters = newest_adapters(run_dir)
    base = str(Path(cfg.model.init_from).expanduser().resolve())
    export_peft(cfg.model, cfg.finetune, adapters, base, load_tokenizer(run_dir / TOKENIZER).to_dict(),
                seq_len_of(cfg), target)
    return target
