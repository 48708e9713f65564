"""Loading a trained run: its config, tokenizer and weights, from a run dir or an export folder.

`load_run` gives a `TrainedRun` (model in eval mode, tokenizer, training context) for `sample`,
`export` and the report's inference check, also from a Hugging Face folder (`load_hf_folder`);
`newest_weights` picks a run dir's newest readable weights (model.pt or its newest good checkpoint).
The export format's file names (`WEIGHTS`, `MODEL_CONFIG`) live here too, beside
`load_exported`/`is_export`, so that `export` (which writes the format) and `sample` (which reads it)
both depend on this module instead of on each other.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_model

from llmtrain.checkpoint.layout import MANIFEST
from llmtrain.checkpoint.read import first_good_checkpoint, read_model_weights, read_weights_file
from llmtrain.config.derived import seq_len_of
from llmtrain.config.hydra import model_config_from_dict
from llmtrain.config.saved import read_saved
from llmtrain.config.schema import Config, ModelConfig
from llmtrain.config.validate import validate_model
from llmtrain.core.errors import CheckpointError, ConfigError, UserError
from llmtrain.core.files import CONFIG, FINAL_WEIGHTS, LORA_BASE, TOKENIZER
from llmtrain.core.readers import UnreadableFile, read_json, require_regular_file
from llmtrain.data.tokenizers import Tokenizer, load_tokenizer
from llmtrain.lora import ADAPTER_MARK, adapter_state, merged_state_dict
from llmtrain.model import GPT, uninitialized
from llmtrain.model_tensors import check_stored, model_tensors
from llmtrain.preflight.estimate import available_memory, format_bytes

# An `llmtrain export` folder: these two files and the run's tokenizer.json.
WEIGHTS = "model.safetensors"
MODEL_CONFIG = "model_config.json"


def adapters_only(weights: dict[str, torch.Tensor]) -> bool:
    """A LoRA run's adapter-only weights (its checkpoints and model.pt with a model.init_from base)."""
    return bool(weights) and all(ADAPTER_MARK in name for name in weights)


class RunBase:
    """The base model a LoRA run's adapter-only weights sit on: the folder the run dir's
    lora_base.json names, checked to hold the same weights (sha256) once, then loaded once; a
    QLoRA run's (the record's `quantized`) as its layers held it: quantized to NF4 and back."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path: str | None = None
        self.quantized: dict | None = None  # how a QLoRA run stored its base (qlora.py NF4_RECORD)
        self._weights: dict[str, torch.Tensor] | None = None

    def check(self) -> str:
        """The base folder's path, once it is known to hold the weights the adapters were trained on."""
        if self.path is not None:
            return self.path
        from llmtrain.hf.lora_base import base_identity, check_same_base

        record_file = self.run_dir / LORA_BASE
        try:
            recorded = read_json(record_file, "the LoRA run's base record")
            where = recorded["path"]
        except (UnreadableFile, KeyError, TypeError):
            raise UserError(f"'{self.run_dir}' holds LoRA adapters alone, and {record_file}, which names the base "
                            "model they belong to, is missing or damaged; the adapters cannot be used without it. "
                            "Restore the file, or retrain the run.") from None
        try:
            current = base_identity(where)
        except ConfigError as err:
            raise UserError(f"'{self.run_dir}' holds LoRA adapters for the base model in {where}, which cannot be "
                            f"read now ({err}). Put that folder back where it was (its safetensors files as they "
                            "were), then run this again.") from None
        check_same_base(recorded, current, f"'{self.run_dir}' holds LoRA adapters alone",
                        "Restore the folder's safetensors files as they were; a merged copy of the model to keep "
                        "whatever the base becomes is `llmtrain export RUN_DIR --format hf`, run while the base is "
                        "the right one.")
        self.path = current["path"]
        self.quantized = recorded.get("quantized")
        return self.path

    def under(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`weights` with the base's tensors beside them when they are adapters alone."""
        if not adapters_only(weights):
            return weights
        if self._weights is None:
            from llmtrain.hf.lora_base import base_weights

            self._weights = base_weights(self.check())
            if self.quantized is not None:
                # The one place a reader's base becomes QLoRA's: merged exports, sample and eval all
                # see the weights the adapters trained against, not the folder's (which differ from
                # them by the 4-bit quantization error). The adapters' names decide the head's.
                from llmtrain.qlora import dequantized_base

                base = dequantized_base({**self._weights, **weights}, self.quantized)
                self._weights = {name: base[name] for name in self._weights}
        return {**self._weights, **weights}


def newest_weights(run_dir: Path, warn: Callable[[str], None] | None = None,
                   model: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """The newest weights of a run (a CPU state_dict): model.pt of a finished run, unless a
    checkpoint is newer (a run extended and interrupted later), else its newest good checkpoint's
    (an interrupted run), whole even when the checkpoint is sharded; a LoRA run's with its adapters
    merged into the weights (lora.py merged_state_dict), on the base folder's weights when the run
    kept its adapters alone (`RunBase`). Whatever cannot be read
    (model.pt or a checkpoint), and with `model` (the run's config) whatever is not exactly that
    model's weights with finite values, is passed over with a warning; with nothing left: UserError."""
    base = RunBase(run_dir)

    def usable(weights: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
        # A LoRA run's weights (frozen base + adapters + their scalings): the merged plain model.
        weights = merged_state_dict(base.under(weights))
        if model is not None:
            try:
                check_weights_fit(model, weights, str(where), "config.yaml")
            except UserError as err:
                raise CheckpointError(str(err)) from None
        return weights

    return _newest(run_dir, warn, usable)


def newest_adapters(run_dir: Path, warn: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """The LoRA adapters (A, B, scalings by llmtrain's names, unmerged) of a run's newest weights,
    chosen as `newest_weights` chooses; an adapter-only run's base folder checked to be the one they
    were trained on."""
    base = RunBase(run_dir)

    def usable(weights: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
        adapters = adapter_state(weights)
        if not adapters:
            raise CheckpointError(f"{where} holds no LoRA adapters")
        if adapters_only(weights):
            base.check()
        return adapters

    return _newest(run_dir, warn, usable)


def _newest(run_dir: Path, warn: Callable[[str], None] | None,
            usable: Callable[[dict[str, torch.Tensor], Path], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """usable(weights, where) of the newest of model.pt and the good checkpoints for which it raises
    no CheckpointError (each one passed over is warned about); with nothing left: UserError."""
    warn = warn or (lambda message: print(f"llmtrain: warning: {message}", file=sys.stderr))
    final = run_dir / FINAL_WEIGHTS
    final_problem: list[str] = []  # empty: model.pt not tried yet

    def read_final() -> dict[str, torch.Tensor] | None:
        try:
            return usable(read_weights_file(final), final)
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
        return usable(read_model_weights(checkpoint), checkpoint)

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
    found.append(f"every checkpoint is damaged or unusable ({'; '.join(f.rstrip('.') for f in failures[:4])})"
                 if failures else "there are no checkpoints")
    raise UserError(
        f"'{run_dir}' has no usable weights: {'; '.join(f.rstrip('.') for f in found)}. "
        "Retrain it (`llmtrain train` with hydra.run.dir set to it and resume=never), or give another run dir "
        "or an `llmtrain export` folder."
    )


def _saved_at(checkpoint: Path) -> float:
    try:
        return (checkpoint / MANIFEST).stat().st_mtime
    except OSError:  # no manifest: the checkpoint is damaged anyway, and model.pt goes first
        return 0.0


def load_exported(export_dir: Path, device: str = "cpu") -> tuple[GPT, int]:
    """(model in eval mode, training context) from an export folder: model_config.json checked
    against model.safetensors' headers before the model is built."""
    from safetensors import safe_open

    meta_file = export_dir / MODEL_CONFIG
    meta = read_json(meta_file, "the export's model config")
    damaged = f"{meta_file} is not the model config `llmtrain export` writes"
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise UserError(f"{damaged} (it needs a \"model\" object); the export is damaged: export the run again.")
    vocab, context = meta.get("vocab_size"), meta.get("context")
    for key, value in (("vocab_size", vocab), ("context", context)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{damaged}: its {key} is {value!r}, not a positive integer; the export is damaged.")
    try:
        model_cfg = model_config_from_dict(meta["model"])
    except ConfigError as err:
        raise UserError(f"{damaged}: {err}") from None
    weights = export_dir / WEIGHTS
    require_regular_file(weights, "the export's weights")
    try:
        with safe_open(str(weights), framework="pt") as handle:
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except Exception as err:  # noqa: BLE001 - safetensors' own error types: a truncated file or a damaged header
        raise UserError(f"{weights} is not a readable safetensors file ({type(err).__name__}: {str(err)[:200]}); the "
                        "export is damaged: export the run again.") from None
    # safetensors stores a tied pair once (save_model keeps one of the two names); load_model re-ties it
    if model_cfg.tie_weights:
        for name, twin in (("wte.weight", "lm_head.weight"), ("lm_head.weight", "wte.weight")):
            if name in shapes:
                shapes.setdefault(twin, shapes[name])
    model = build_model(model_cfg, vocab, shapes, str(weights), MODEL_CONFIG)
    try:
        load_model(model, str(weights), device=device)
    except Exception as err:  # noqa: BLE001 - a tensor whose bytes do not match its header
        raise UserError(f"{weights} cannot be loaded ({type(err).__name__}: {str(err)[:200]}); the export is "
                        "damaged: export the run again.") from None
    require_finite(model.state_dict(), str(weights))
    return model.to(device).eval(), context


def is_export(path: Path) -> bool:
    return (path / WEIGHTS).is_file() and (path / MODEL_CONFIG).is_file()


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face model folder (`llmtrain export --format hf`, or transformers' save_pretrained):
    config.json, safetensors weights (whole or sharded) and tokenizer.json."""
    from llmtrain.core.hf_files import CONFIG as HF_CONFIG
    from llmtrain.core.hf_files import TOKENIZER as HF_TOKENIZER
    from llmtrain.core.hf_files import WEIGHTS_INDEX

    weights = (path / WEIGHTS).is_file() or (path / WEIGHTS_INDEX).is_file()
    return weights and (path / HF_CONFIG).is_file() and (path / HF_TOKENIZER).is_file() and not is_export(path)


def load_hf_folder(path: Path, device: str = "cpu") -> TrainedRun:
    """A GPT-2 or Llama-family Hugging Face folder as a `TrainedRun`: the model its config.json
    describes, its weights, its tokenizer.json (data.tokenizer=pretrained's tokenizer), and as
    context the shorter of the model's positions and the tokenizer's model_max_length."""
    from llmtrain.data.tokenizers import PretrainedTokenizer
    from llmtrain.hf.folder import HFFolder, check_weights, load_weights

    folder = HFFolder.open(str(path), key="RUN_DIR")  # refuses an unsupported architecture by name
    fields = folder.model_fields()
    model_cfg = ModelConfig(name=folder.name, **fields)
    check_model(model_cfg, str(path / "config.json"))
    check_weights(folder, model_cfg)  # from the headers: every tensor, its shape and dtype, no tensor left over
    tokenizer = PretrainedTokenizer.from_folder(str(path), key="RUN_DIR")
    model = build_model(model_cfg, model_cfg.vocab_size, None, str(path), "config.json")
    load_weights(model, folder)  # refuses NaN or infinite values
    return TrainedRun(model.to(device).eval(), tokenizer, min(model.cfg.block_size, _max_length(path)))


def _max_length(path: Path) -> int:
    """tokenizer_config.json's model_max_length (transformers writes ~1e30 when it is unknown)."""
    from llmtrain.core.hf_files import TOKENIZER_CONFIG

    try:
        settings = read_json(path / TOKENIZER_CONFIG, "the tokenizer's settings")
    except UnreadableFile:
        return sys.maxsize  # optional file: the model's positions decide
    value = settings.get("model_max_length") if isinstance(settings, dict) else None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and 1 <= value < sys.maxsize \
        else sys.maxsize


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
    if is_hf_folder(run_dir) or (os.path.lexists(run_dir / "config.json") and not os.path.lexists(run_dir / CONFIG)):
        return load_hf_folder(run_dir, device)
    needed = [run_dir / name for name in (CONFIG, TOKENIZER)]
    missing = [p.name for p in needed if not p.is_file()]
    if missing:
        raise UserError(
            f"'{run_dir}' is not an llmtrain run directory or export: {', '.join(missing)} missing. "
            "Give the directory that `llmtrain train` printed in its banner (e.g. outputs/<date>/<time>)."
        )
    cfg = run_config(run_dir)
    tokenizer = load_tokenizer(needed[1])
    # Weights load with weights_only=True (or as bare tensors from shards): they cannot run code; each
    # candidate must be exactly the model config.yaml describes, or the next one is tried.
    state = newest_weights(run_dir, model=cfg.model)
    model = build_model(cfg.model, state["wte.weight"].shape[0], None, str(run_dir), CONFIG)
    model.load_state_dict(state)  # shapes and names checked by newest_weights
    return TrainedRun(model.to(device).eval(), tokenizer, seq_len_of(cfg), needed[1])


def run_config(run_dir: Path) -> Config:
    """A run dir's config.yaml as a validated `Config` (config/saved.py: read within bounds)."""
    return read_saved(Path(run_dir) / CONFIG)


def check_model(model: ModelConfig, config_name: str) -> None:
    """A model description read from a file, checked as `train` checks its own (positive sizes,
    heads that divide the width, ...) before anything is built from it."""
    try:
        validate_model(model)
    except ConfigError as err:
        raise UserError(f"{config_name} describes a model llmtrain cannot build: {err}") from None


def check_weights_fit(model: ModelConfig, state: dict[str, torch.Tensor], where: str, config_name: str) -> None:
    """`state` is exactly the model `model` describes (tensors, shapes, finite values)."""
    embedding = state.get("wte.weight")
    if embedding is None or embedding.dim() != 2 or embedding.shape[0] < 1:
        raise UserError(f"{where}: the weights hold no token embedding (wte.weight), so they are not an llmtrain "
                        "model's; give a run directory that `llmtrain train` wrote.")
    check_model(model, config_name)
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    check_stored(model_tensors(model, embedding.shape[0]), shapes, where, config_name)
    require_finite(state, where)


def require_finite(state: dict[str, torch.Tensor], where: str) -> None:
    bad = [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise UserError(f"{where}: the weights hold NaN or infinite values ({', '.join(bad[:3])}); a model cannot "
                        "generate or be evaluated from them.")


def build_model(model: ModelConfig, vocab_size: int, stored: dict[str, tuple[int, ...]] | None, where: str,
                config_name: str) -> GPT:
    """`GPT(model, vocab_size)` without its random init (every tensor is overwritten next), once the
    description is known to fit: `stored` (the weights' shapes, when not checked already) and this
    machine's free memory."""
    check_model(model, config_name)
    tensors = model_tensors(model, vocab_size)
    if stored is not None:
        check_stored(tensors, stored, where, config_name)
    need = tensors.build_bytes()
    free, source = available_memory(torch.device("cpu"))
    if need > free:
        raise UserError(f"{where}: the model {config_name} describes needs {format_bytes(need)} to build "
                        f"({tensors.n_params:,} parameters), more than the {format_bytes(free)} free here ({source}).")
    with uninitialized():
        return GPT(model, vocab_size)
