"""Which checkpoint a run resumes from (resume=auto|never|PATH), and whether it fits: shapes,
tokenizer, damaged folders set aside."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmtrain.checkpoint.format import restore_rng
from llmtrain.checkpoint.layout import MANIFEST, Checkpoint, checkpoint_root
from llmtrain.checkpoint.read import find_good_checkpoint, list_checkpoints, load_checkpoint, load_newest_good
from llmtrain.core import files
from llmtrain.core.errors import (
    CheckpointError,
    ConfigError,
    UserError,
)
from llmtrain.core.files import CHECKPOINTS
from llmtrain.data import EpochSampler, InstructionSampler, RandomWindowSampler
from llmtrain.data.tokenizers import Tokenizer
from llmtrain.distributed.layout import (
    Layout,
    broadcast_from_main,
)
from llmtrain.engine.state import TrainState
from llmtrain.metrics.dashboard import Dashboard


def all_damaged(run_dir: Path, failures: list[str], what: str, own: bool = True) -> CheckpointError:
    """The refusal when every checkpoint of a run dir is damaged: which, why, and the ways on.
    `own`: the run dir is the one being trained into (resume=never would start it over)."""
    root = f"{checkpoint_root(run_dir)}{os.sep}"
    listed = "; ".join(f.replace(root, "") for f in failures[:6]) + (f"; and {len(failures) - 6} more" if len(failures) > 6 else "")
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
        found = _newest_or_refuse(path, warn, device, f"resume='{resume}'", own=path.resolve() == Path(run_dir).resolve())
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


# Keys whose change makes saved tensors or optimizer state meaningless for the new run.
SHAPE_KEYS = (
    "model.n_layer", "model.n_head", "model.n_kv_head", "model.n_embd", "model.block_size", "model.vocab_size",
    "model.bias", "model.tie_weights", "model.position", "model.norm", "model.mlp", "model.mlp_ratio",
    "model.intermediate_size", "model.rope_theta", "model.norm_eps", "model.norm_position",
    "data.source", "data.path", "data.tokenizer", "data.bpe_vocab_size", "data.text_field", "data.sampling",
    "data.hf_name", "data.hf_config", "data.hf_split", "optim.name", "optim.decay_embeddings",
)


# Keys that never matter for resuming.
IGNORED_KEYS = ("out_dir", "resume")


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for every key that differs, ignored keys left out. A key
    the saved config lacks (it was added to llmtrain after the checkpoint was written) counts as
    its schema default, which is what that older run used; a key renamed since is read in today's
    spelling (`report: true` is report.enabled)."""
    from llmtrain.config.hydra import migrate_config_dict
    from llmtrain.config.schema import Config, config_to_dict

    old = {**_flatten(config_to_dict(Config())), **_flatten(migrate_config_dict(saved))}
    new = _flatten(current)
    keys = sorted(set(old) | set(new))
    return [(k, old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k) and k not in IGNORED_KEYS]


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


def check_resumable(checkpoint: Checkpoint, config_dict: dict) -> None:
    """Refuse config changes that make the saved state meaningless (shapes, data, optimizer kind)."""
    refused = [c for c in config_changes(checkpoint.trainer["config"], config_dict) if c[0] in SHAPE_KEYS]
    if refused:
        listed = "; ".join(f"{k}: {old} -> {new}" for k, old, new in refused)
        raise ConfigError(
            f"Cannot resume from {checkpoint.path}: {listed}. These change the model's shapes, its data or its "
            "optimizer, so the saved state does not fit. Undo the change, or start a new run dir (hydra.run.dir=...)."
        )


def check_same_tokenizer(checkpoint: Checkpoint, tokenizer: Tokenizer) -> None:
    """The data must speak the run's token ids: the same settings can still give another tokenizer
    (a changed corpus retrains BPE or changes a char vocabulary; other GPT-2 files; a BPE sample)."""
    saved = checkpoint.path.parent.parent / files.TOKENIZER  # <run dir>/checkpoints/step_N
    if not saved.is_file():
        return
    try:
        recorded = json.loads(saved.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"Cannot resume from {checkpoint.path}: the run's {saved} cannot be read ({err}), so it is "
                          "unknown which token ids the model was trained on; restore that file, or start a new run "
                          "dir (hydra.run.dir=...).") from None
    if recorded != tokenizer.to_dict():
        raise ConfigError(
            f"Cannot resume from {checkpoint.path}: the data's tokenizer is not the one this run was trained with "
            f"({saved}), so every token id would mean something else to the model. The corpus or a tokenizer setting "
            "changed since: restore them, or start a new run dir (hydra.run.dir=...)."
        )


def restore(
    checkpoint: Checkpoint, config_dict: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None, sampler: RandomWindowSampler | EpochSampler | InstructionSampler,
    sink: Dashboard,
) -> TrainState:
    """Load a checkpoint into the freshly built objects and report what came back and what changed."""
    changes = config_changes(checkpoint.trainer["config"], config_dict)
    try:
        checkpoint.load_into(model, optimizer)  # an FSDP2 run reads just its shards of a sharded checkpoint
    except (RuntimeError, ValueError, KeyError) as err:
        raise ConfigError(f"Cannot resume from {checkpoint.path}: its state does not fit this model/optimizer ({err}).") from None
    try:  # checked when loaded, but a forged value can still be of the wrong kind for its object
        if scaler is not None and checkpoint.scaler is not None:
            scaler.load_state_dict(checkpoint.scaler)
        sampler.load_state_dict(checkpoint.trainer["sampler"])
        restore_rng(checkpoint.rng, checkpoint.trainer["rng"])
    except Exception as err:  # noqa: BLE001 - any malformed state: a damaged checkpoint, not a crash
        raise CheckpointError(f"{checkpoint.path}: its loss-scaler, data-position or RNG state cannot be restored "
                              f"({type(err).__name__}: {str(err)[:200]}); resume from another checkpoint "
                              "(resume=<folder>) or train into another run dir (hydra.run.dir=...).") from None
    state = checkpoint.state
    sink.print(
        f"[bold green]resumed[/] from {checkpoint.path}: step {state.step}, {state.tokens:,} tokens, "
        f"model + optimizer{' + loss scaler' if checkpoint.scaler else ''} + data position + RNG states"
        + (f", best val loss {state.best_val_loss:.4f} (step {state.best_step})" if state.best_val_loss is not None else "")
    )
    for key, old, new in changes:
        sink.print(f"[bold yellow]config changed since the checkpoint:[/] {key}: {old} -> {new}")
    return state
