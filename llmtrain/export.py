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

from llmtrain.checkpoint import (
    MANIFEST,
    CheckpointError,
    first_good_checkpoint,
    read_model_weights,
    read_weights_file,
)
from llmtrain.config import config_to_dict, model_config_from_dict
from llmtrain.errors import UserError
from llmtrain.model import GPT

WEIGHTS = "model.safetensors"
MODEL_CONFIG = "model_config.json"


def newest_weights(run_dir: Path, warn: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """The newest weights of a run (a CPU state_dict): model.pt of a finished run, unless a
    checkpoint is newer (a run extended and interrupted later), else its newest good checkpoint's
    (an interrupted run), whole even when the checkpoint is sharded. Whatever cannot be read
    (model.pt or a checkpoint) is passed over with a warning; with nothing left: UserError."""
    warn = warn or (lambda message: print(f"llmtrain: warning: {message}", file=sys.stderr))
    final = run_dir / "model.pt"
    final_problem: list[str] = []  # empty: model.pt not tried yet

    def read_final() -> dict[str, torch.Tensor] | None:
        try:
            return read_weights_file(final)
        except CheckpointError as err:
            final_problem.append(str(err))
            warn(f"{err}; trying the checkpoints instead")
            return None

    def newest_of(checkpoint: Path) -> dict[str, torch.Tensor]:
        # model.pt first while it is newer than this checkpoint (older ones never beat it)
        if final.is_file() and not final_problem and final.stat().st_mtime >= _saved_at(checkpoint):
            weights = read_final()
            if weights is not None:
                return weights
        return read_model_weights(checkpoint)

    failures: list[str] = []
    weights = first_good_checkpoint(run_dir, newest_of, warn, failures)
    if weights is None and final.is_file() and not final_problem:
        weights = read_final()
    if weights is not None:
        return weights
    if not final_problem and not failures:
        raise UserError(
            f"'{run_dir}' has no weights: neither model.pt (a finished run) nor a usable checkpoint "
            "under checkpoints/. Give a run directory that `llmtrain train` wrote."
        )
    found = final_problem or [f"{final} does not exist"]
    found.append(f"every checkpoint is damaged ({'; '.join(failures[:4])})" if failures else "there are no checkpoints")
    raise UserError(
        f"'{run_dir}' has no usable weights: {'; '.join(found)}. Retrain it (`llmtrain train` with "
        "hydra.run.dir set to it and resume=never), or give another run dir or an `llmtrain export` folder."
    )


def _saved_at(checkpoint: Path) -> float:
    try:
        return (checkpoint / MANIFEST).stat().st_mtime
    except OSError:  # no manifest: the checkpoint is damaged anyway, and model.pt goes first
        return 0.0


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
