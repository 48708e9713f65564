"""Whether a checkpoint fits the run that would resume from it: the config keys whose change
makes its state meaningless (`SHAPE_KEYS`: shapes, data, optimizer kind), what else changed
(`config_changes`, shown on resume), and the data's tokenizer. Which checkpoint a run resumes from
is the run's decision: training/resume.py."""

from __future__ import annotations

import json
from typing import Any

from llmtrain.checkpoint.layout import Checkpoint
from llmtrain.core import files
from llmtrain.core.errors import ConfigError
from llmtrain.data.tokenizers import Tokenizer

# Keys whose change makes saved tensors or optimizer state meaningless for the new run.
SHAPE_KEYS = (
    "model.n_layer", "model.n_head", "model.n_kv_head", "model.n_embd", "model.block_size", "model.vocab_size",
    "model.bias", "model.tie_weights", "model.position", "model.norm", "model.mlp", "model.mlp_ratio",
    "model.intermediate_size", "model.rope_theta", "model.norm_eps", "model.norm_position",
    "data.source", "data.path", "data.tokenizer", "data.bpe_vocab_size", "data.text_field", "data.sampling",
    "data.hf_name", "data.hf_config", "data.hf_split", "optim.name", "optim.decay_embeddings",
    # what trains, and the adapters' shapes and meaning (their saved scaling is alpha / rank)
    "finetune.method", "finetune.rank", "finetune.alpha", "finetune.targets",
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
