"""Loading a trained run: its config, tokenizer and weights, from a run dir or an export folder.

`load_run` gives a `TrainedRun` (model in eval mode, tokenizer, training context) for `sample`,
`export` and the report's inference check, also from a Hugging Face folder (`load_hf_folder`); `newest_weights` picks a run dir's newest readable
weights (model.pt or its newest good checkpoint). The export format's file names (`WEIGHTS`,
`MODEL_CONFIG`) live here too, beside `load_exported`/`is_export`, so that `export` (which writes
the format) and `sample` (which reads it) both depend on this module instead of on each other.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_model

from llmtrain.checkpoint.format import MANIFEST, first_good_checkpoint, read_model_weights, read_weights_file
from llmtrain.config.derived import seq_len_of
from llmtrain.config.hydra import config_from_dict, model_config_from_dict
from llmtrain.data.tokenizers import Tokenizer, load_tokenizer
from llmtrain.errors import CheckpointError, ConfigError, UserError
from llmtrain.model import GPT, uninitialized
from llmtrain.runs.files import CONFIG, FINAL_WEIGHTS, TOKENIZER

# An `llmtrain export` folder: these two files and the run's tokenizer.json.
WEIGHTS = "model.safetensors"
MODEL_CONFIG = "model_config.json"


def newest_weights(run_dir: Path, warn: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """The newest weights of a run (a CPU state_dict): model.pt of a finished run, unless a
    checkpoint is newer (a run extended and interrupted later), else its newest good checkpoint's
    (an interrupted run), whole even when the checkpoint is sharded. Whatever cannot be read
    (model.pt or a checkpoint) is passed over with a warning; with nothing left: UserError."""
    warn = warn or (lambda message: print(f"llmtrain: warning: {message}", file=sys.stderr))
    final = run_dir / FINAL_WEIGHTS
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


def load_exported(export_dir: Path, device: str = "cpu") -> tuple[GPT, int]:
    """(model in eval mode, training context) from an export folder."""
    meta = json.loads((export_dir / MODEL_CONFIG).read_text())
    model_cfg = model_config_from_dict(meta["model"])
    with uninitialized():  # load_model (strict) overwrites every parameter
        model = GPT(model_cfg, int(meta["vocab_size"]))
    load_model(model, str(export_dir / WEIGHTS), device=device)
    return model.to(device).eval(), int(meta["context"])


def is_export(path: Path) -> bool:
    return (path / WEIGHTS).is_file() and (path / MODEL_CONFIG).is_file()


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face model folder (`llmtrain export --format hf`, or transformers' save_pretrained):
    config.json, safetensors weights (whole or sharded) and tokenizer.json."""
    from llmtrain.hf.folder import CONFIG as HF_CONFIG
    from llmtrain.hf.folder import TOKENIZER as HF_TOKENIZER
    from llmtrain.hf.folder import WEIGHTS_INDEX

    weights = (path / WEIGHTS).is_file() or (path / WEIGHTS_INDEX).is_file()
    return weights and (path / HF_CONFIG).is_file() and (path / HF_TOKENIZER).is_file() and not is_export(path)


def load_hf_folder(path: Path, device: str = "cpu") -> TrainedRun:
    """A GPT-2 or Llama-family Hugging Face folder as a `TrainedRun`: the model its config.json
    describes, its weights, its tokenizer.json (data.tokenizer=pretrained's tokenizer), and as
    context the shorter of the model's positions and the tokenizer's model_max_length."""
    from llmtrain.config.schema import ModelConfig
    from llmtrain.data.tokenizers import PretrainedTokenizer
    from llmtrain.hf.folder import HFFolder, load_weights

    folder = HFFolder.open(str(path), key="RUN_DIR")  # refuses an unsupported architecture by name
    fields = folder.model_fields()
    tokenizer = PretrainedTokenizer.from_folder(str(path), key="RUN_DIR")
    model = GPT(ModelConfig(name=folder.name, **fields), int(fields["vocab_size"]))
    load_weights(model, folder)
    return TrainedRun(model.to(device).eval(), tokenizer, min(model.cfg.block_size, _max_length(path)))


def _max_length(path: Path) -> int:
    """tokenizer_config.json's model_max_length (transformers writes ~1e30 when it is unknown)."""
    from llmtrain.hf.folder import TOKENIZER_CONFIG

    try:
        value = json.loads((path / TOKENIZER_CONFIG).read_text()).get("model_max_length")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return sys.maxsize  # optional file: the model's positions decide
    return int(value) if isinstance(value, (int, float)) and 0 < value < sys.maxsize else sys.maxsize


@dataclass
class TrainedRun:
    model: GPT  # in eval mode
    tokenizer: Tokenizer
    context: int  # the sequence length it was trained on: positions past it were never seen
    tokenizer_file: Path | None = None  # llmtrain's tokenizer.json it came from (None: a Hugging Face folder's)


def load_run(run_dir: Path, device: str = "cpu") -> TrainedRun:
    """The trained model, its tokenizer and its training context from a run directory (its final
    weights, else its newest good checkpoint's), an `llmtrain export` folder (either format), or a
    GPT-2 / Llama-family Hugging Face folder."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(
            f"'{run_dir}' does not exist; give a run directory that `llmtrain train` wrote "
            "(its banner prints it, e.g. outputs/<date>/<time>), a folder written by `llmtrain export`, or a local "
            "Hugging Face model folder."
        )
    if is_export(run_dir):
        model, context = load_exported(run_dir, device)
        return TrainedRun(model, load_tokenizer(run_dir / TOKENIZER), context, run_dir / TOKENIZER)
    # config.json without config.yaml: a Hugging Face folder, whose own checks name what it lacks
    if is_hf_folder(run_dir) or ((run_dir / "config.json").is_file() and not (run_dir / CONFIG).is_file()):
        return load_hf_folder(run_dir, device)
    needed = [run_dir / name for name in (CONFIG, TOKENIZER)]
    missing = [p.name for p in needed if not p.is_file()]
    if missing:
        raise UserError(
            f"'{run_dir}' is not an llmtrain run directory or export: {', '.join(missing)} missing. "
            "Give the directory that `llmtrain train` printed in its banner (e.g. outputs/<date>/<time>)."
        )
    try:
        # libyaml's loader where PyYAML has it: the same safe subset, ~10x faster than the pure-Python one
        data = yaml.load(needed[0].read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506
        if not isinstance(data, dict):
            raise ConfigError("it holds no mapping of config groups")
        cfg = config_from_dict(data)
    except yaml.YAMLError as err:
        raise UserError(f"'{needed[0]}' is not readable YAML ({str(err).splitlines()[0]}); it is the config "
                        "`llmtrain train` wrote, so the run directory is damaged.") from None
    except ConfigError as err:
        raise UserError(f"'{needed[0]}' is not a valid llmtrain config: {err}") from None
    tokenizer = load_tokenizer(needed[1])
    # Weights load with weights_only=True (or as bare tensors from shards): they cannot run code.
    state = newest_weights(run_dir)
    embedding = state.get("wte.weight")
    if embedding is None or embedding.dim() != 2:
        raise UserError(f"'{run_dir}': its weights hold no token embedding (wte.weight), so they are not an llmtrain "
                        "model's; give a run directory that `llmtrain train` wrote.")
    with uninitialized():  # every parameter is overwritten next (strict), so its random init is skipped
        model = GPT(cfg.model, embedding.shape[0])
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[1:2] or [str(err)]
        raise UserError(f"'{run_dir}': its weights do not fit its config.yaml ({first[0].strip()[:300]}).") from None
    return TrainedRun(model.to(device).eval(), tokenizer, seq_len_of(cfg), needed[1])
