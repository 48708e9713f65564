"""Which checkpoint a run resumes from, a training decision: resume=auto (this run dir's newest
good one), never (a fresh start; damaged checkpoints are set aside once the run is accepted) or a
path; agreed by the ranks, refused unless it fits the config and the data's tokenizer
(checkpoint/resume.py); then `restore`d into the run's freshly built objects."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from llmtrain.checkpoint.layout import MANIFEST, Checkpoint, checkpoint_root
from llmtrain.checkpoint.read import find_good_checkpoint, list_checkpoints, load_checkpoint, load_newest_good
from llmtrain.checkpoint.resume import check_resumable, check_same_tokenizer, config_changes
from llmtrain.checkpoint.rng import restore_rng
from llmtrain.config.schema import Config
from llmtrain.core.errors import CheckpointError, ConfigError, UserError
from llmtrain.core.files import CHECKPOINTS
from llmtrain.data.tokenizers import Tokenizer
from llmtrain.distributed.layout import Layout, broadcast_from_main
from llmtrain.engine.state import TrainState
from llmtrain.hf.lora_base import BASE_RECORD, check_same_base
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.training.parts import Sampler, TrainModule


def choose_resume(cfg: Config, run_dir: Path, warn: Callable[[str], None], device: torch.device, layout: Layout,
                  config_dict: dict, tokenizer: Tokenizer, lora_base: dict | None = None) -> Checkpoint | None:
    """The checkpoint to resume from (agreed by the ranks), refused unless it fits the config, the
    data's tokenizer and (`lora_base`: a LoRA run's base folder, as it is now) the base its adapters
    were trained on; None for a fresh start."""
    checkpoint = agreed_resume(cfg.resume, run_dir, warn, device, layout)
    if checkpoint is not None:
        check_resumable(checkpoint, config_dict)
        check_same_tokenizer(checkpoint, tokenizer)
        check_lora_base(checkpoint, lora_base)
    return checkpoint


def check_lora_base(checkpoint: Checkpoint, lora_base: dict | None) -> None:
    """An adapter-only checkpoint resumes only on the base it was trained on: the same weights
    (the sha256 of the folder's safetensors), wherever the folder now is. A whole-model checkpoint
    (a LoRA run from scratch, or one written before adapter-only checkpoints) holds its base itself."""
    recorded = checkpoint.trainer.get(BASE_RECORD)
    if recorded is None:
        return
    what = f"Cannot resume from {checkpoint.path}"
    if lora_base is None:
        where = recorded.get("path") if isinstance(recorded, dict) else None
        method = "qlora" if isinstance(recorded, dict) and recorded.get("quantized") else "lora"
        raise ConfigError(f"{what}: it holds LoRA adapters alone, for the base model in {where}, and this run has no "
                          f"base folder to put them on (it is not a LoRA run with model.init_from). Resume with "
                          f"finetune={method} model.init_from={where}, or start a new run dir (hydra.run.dir=...).")
    check_same_base(recorded, lora_base, what,
                    "If the folder changed by mistake, restore its safetensors files and resume again; if the new "
                    "weights are intended, train them in a new run dir (hydra.run.dir=...), since resuming would "
                    "continue adapters made for the old ones.")


def all_damaged(run_dir: Path, failures: list[str], what: str, own: bool = True) -> CheckpointError:
    """The refusal when every checkpoint of a run dir is damaged: which, why, and the ways on.
    `own`: the run dir is the one being trained into (resume=never would start it over)."""
    root = f"{checkpoint_root(run_dir)}{os.sep}"
    listed = ("; ".join(f.replace(root, "") for f in failures[:6])
              + (f"; and {len(failures) - 6} more" if len(failures) > 6 else ""))
    ways = ("resume=never starts this run over from step 0 and first moves the damaged checkpoints aside (to "
            f"{CHECKPOINTS}.damaged-<time>/ in the run dir); resume=<a checkpoint folder or another run dir> continues "
            "from a good checkpoint elsewhere; or train into another run dir (hydra.run.dir=...)." if own else
            "resume=<another checkpoint folder or run dir>, or resume=never to start from step 0.")
    return CheckpointError(
        f"{what}: every checkpoint in {checkpoint_root(run_dir)} is damaged, so there is nothing to resume from "
        f"({listed}). No checkpoint was changed. Ways on: {ways}"
    )


def move_damaged_aside(run_dir: Path) -> Path:
    """Rename the checkpoints folder (every damaged checkpoint and `latest`, byte for byte) to
    checkpoints.damaged-<YYYYmmdd-HHMMSS>/ in the run dir, so a fresh run overwrites none of it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = Path(run_dir) / f"{CHECKPOINTS}.damaged-{stamp}"
    n = 1
    while target.exists():  # twice in the same second
        n += 1
        target = Path(run_dir) / f"{CHECKPOINTS}.damaged-{stamp}-{n}"
    os.replace(checkpoint_root(run_dir), target)
    return target


def _quiet(message: str) -> None:
    """A warn() that drops its message (the caller reports the outcome itself)."""


def resume_checkpoint(
    resume: str, run_dir: Path, warn: Callable[[str], None], device: torch.device | str = "cpu"
) -> Checkpoint | None:
    """The checkpoint `resume=` asks for, loaded: auto (this run dir's newest good one), never, or a path.
    A run dir whose checkpoints are all damaged is refused (auto), or moved aside first (never)."""
    if resume == "never":
        return _start_over(run_dir)
    if resume == "auto":
        return _newest_or_refuse(run_dir, warn, device, "Cannot resume (resume=auto)")
    path = Path(resume).expanduser()
    if (path / MANIFEST).is_file():
        try:
            return load_checkpoint(path, device)
        except CheckpointError as err:
            raise CheckpointError(f"resume='{resume}' cannot be used: {err}. Give another checkpoint folder or run "
                                  "dir, or resume=auto (this run dir's newest good checkpoint).") from None
    if checkpoint_root(path).is_dir():
        found = _newest_or_refuse(path, warn, device, f"resume='{resume}'",
                                  own=path.resolve() == Path(run_dir).resolve())
        if found is None:
            raise ConfigError(f"resume='{resume}': no usable checkpoint in {checkpoint_root(path)}.")
        return found
    raise ConfigError(
        f"resume='{resume}' is neither a checkpoint folder (with {MANIFEST}) nor a run dir with {CHECKPOINTS}/; "
        "valid: auto, never, or such a path."
    )


def _newest_or_refuse(run_dir: Path, warn: Callable[[str], None], device: torch.device | str,
                      what: str, own: bool = True) -> Checkpoint | None:
    """The newest good checkpoint (each damaged one passed over is warned about); None when there
    are none at all; refused when there are some and every one is damaged."""
    passed_over: list[str] = []
    failures: list[str] = []
    found = load_newest_good(run_dir, passed_over.append, device, failures)
    if found is None and failures:
        raise all_damaged(run_dir, failures, what, own)
    for message in passed_over:  # only now: a refusal above names them all in one paragraph
        warn(message)
    return found


def _start_over(run_dir: Path) -> None:
    """resume=never: refused while a good checkpoint would be overwritten. Damaged ones only are
    left where they are here: the run moves them aside once it is accepted (`set_damaged_aside`),
    so a command refused later still leaves the run dir as it was."""
    if list_checkpoints(run_dir) and find_good_checkpoint(run_dir, _quiet, readable=True) is not None:
        raise ConfigError(
            f"resume=never, but {checkpoint_root(run_dir)} already holds checkpoints that a fresh run would "
            "overwrite; use resume=auto to continue it, or another run dir (hydra.run.dir=...)."
        )


def set_damaged_aside(run_dir: Path, warn: Callable[[str], None]) -> None:
    """A fresh run (resume=never) in a run dir whose checkpoints are all damaged (resume_checkpoint
    refused it otherwise): move them aside, said in one line, rather than overwrite them."""
    if not list_checkpoints(run_dir):
        return
    names = ", ".join(p.name for p in list_checkpoints(run_dir))
    target = move_damaged_aside(run_dir)
    warn(f"resume=never: every checkpoint here was damaged ({names}); moved them aside to {target} and starting over")


def agreed_resume(resume: str, run_dir: Path, warn: Callable[[str], None], device: torch.device,
                  layout: Layout) -> Checkpoint | None:
    """The checkpoint `resume=` names, chosen and verified by rank 0 and read by every rank: one
    rank hashes the files, and all resume from the same step. A refusal is raised on every rank."""
    if not layout.distributed:
        return resume_checkpoint(resume, run_dir, warn, device)
    found, chosen, refusal = None, None, None
    if layout.is_main:
        try:
            found = resume_checkpoint(resume, run_dir, warn, device)
            chosen = found.path if found is not None else None
        except UserError as err:
            refusal = str(err)
    chosen, refusal = broadcast_from_main((chosen, refusal), layout)
    if refusal is not None:
        raise ConfigError(refusal)
    if layout.is_main or chosen is None:
        return found
    return load_checkpoint(chosen, device, verify_files=False)



def restore(checkpoint: Checkpoint, config_dict: dict, module: TrainModule, sampler: Sampler,
            dashboard: Dashboard) -> TrainState:
    """Load a checkpoint into the freshly built objects (through the module's state views) and report
    what came back and what changed."""
    changes = config_changes(checkpoint.trainer["config"], config_dict)
    try:  # an FSDP2 run reads just its shards of a sharded checkpoint
        checkpoint.load_into(module.model_state, module.optimizer_state)
    except (RuntimeError, ValueError, KeyError) as err:
        raise ConfigError(f"Cannot resume from {checkpoint.path}: its state does not fit this model/optimizer "
                          f"({err}).") from None
    try:  # checked when loaded, but a forged value can still be of the wrong kind for its object
        module.precision.load_state_dict(checkpoint.scaler)
        sampler.load_state_dict(checkpoint.trainer["sampler"])
        restore_rng(checkpoint.rng, checkpoint.trainer["rng"])
    except Exception as err:  # noqa: BLE001 - any malformed state: a damaged checkpoint, not a crash
        raise CheckpointError(f"{checkpoint.path}: its loss-scaler, data-position or RNG state cannot be restored "
                              f"({type(err).__name__}: {str(err)[:200]}); resume from another checkpoint "
                              "(resume=<folder>) or train into another run dir (hydra.run.dir=...).") from None
    state = checkpoint.state
    dashboard.print(
        f"[bold green]resumed[/] from {checkpoint.path}: step {state.step}, {state.tokens:,} tokens, "
        f"model + optimizer{' + loss scaler' if checkpoint.scaler else ''} + data position + RNG states"
        + (f", best val loss {state.best_val_loss:.4f} (step {state.best_step})" if state.best_val_loss is not None
           else "")
    )
    for key, old, new in changes:
        dashboard.print(f"[bold yellow]config changed since the checkpoint:[/] {key}: {old} -> {new}")
    return state
