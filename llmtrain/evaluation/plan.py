"""What `llmtrain eval MODEL_DIR [overrides]` evaluates, decided before the model is loaded.

In order: the eval.tasks entries of the command line (and `harness.tasks=[...]`, shorthand for
harness:TASK entries); `data=... data.path=...` on the command line, the perplexity of that data;
with neither, a run dir's own eval.tasks (the tasks it was trained with), else its validation split.
An export or a Hugging Face folder has no data of its own, so it needs a task named. Every file is
read and checked here (read_tasks), so a bad line is refused before any model work.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmtrain.config.eval_tasks import VALIDATION, parse_task_specs
from llmtrain.config.saved import read_saved
from llmtrain.config.schema import Config, EvalConfig
from llmtrain.core.errors import ConfigError, UserError
from llmtrain.core.files import CONFIG
from llmtrain.evaluation.tasks import TaskSource, data_source, read_tasks, validation_source

# Overrides `llmtrain eval` takes: the eval section, the data to measure, and the harness shorthand.
HARNESS_SHORTHAND = "harness.tasks"
# A run's own eval.tasks are evaluated with these settings of the run (unless the command line sets them).
SAVED_SETTINGS = ("text_field", "harness_include", "stride", "truncate")


@dataclass
class Plan:
    sources: list[TaskSource]
    settings: EvalConfig  # the eval.* settings the tasks are scored with
    validation_of: Config | None = None  # score this run's validation split too (its data config)
    notes: list[str] = field(default_factory=list)  # said before the evaluation starts


def allowed_override(override: str) -> bool:
    key = override.lstrip("+~").split("=", 1)[0]
    return key == "data" or key.startswith(("data.", "eval.")) or key == HARNESS_SHORTHAND


def split_harness_shorthand(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides without harness.tasks=..., the harness:TASK entries it names)."""
    rest, entries = [], []
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if key != HARNESS_SHORTHAND:
            rest.append(override)
            continue
        names = [n.strip().strip("'\"") for n in value.strip().removeprefix("[").removesuffix("]").split(",")]
        if not any(names):
            raise ConfigError(f"'{override}' names no task; give harness.tasks=[TASK,...], "
                              "e.g. harness.tasks=[hellaswag].")
        entries += [f"harness:{n}" for n in names if n]
    return rest, entries


def plan(model_dir: Path, cfg: Config, data_named: bool, harness_entries: list[str],
         eval_keys: frozenset[str] = frozenset()) -> Plan:
    """The task sources to evaluate MODEL_DIR on, read and checked (UserError for a bad one).
    `eval_keys`: the eval.* keys the command line set (they win over a run's saved settings)."""
    specs = parse_task_specs([*cfg.eval.tasks, *harness_entries])
    saved = saved_config(model_dir)
    settings, note = cfg.eval, None
    if not specs and not data_named and saved is not None and saved.eval.tasks:
        # the run's own tasks, read and scored as it did (not its limit: that kept evaluations during
        # training short; here the files are scored whole unless the command line says otherwise)
        kept = {k: getattr(saved.eval, k) for k in SAVED_SETTINGS if k not in eval_keys}
        settings = dataclasses.replace(cfg.eval, **kept)
        specs = parse_task_specs(saved.eval.tasks, key=f"eval.tasks of {model_dir / CONFIG}")
        note = f"no task named: evaluating the run's own eval.tasks ({', '.join(saved.eval.tasks)})"
    # perplexity:validation of a run dir is read once its data is at hand (after the model loads)
    own_split = saved is not None and VALIDATION in specs
    result = Plan(read_tasks([s for s in specs if not (own_split and s == VALIDATION)], settings), settings,
                  validation_of=saved if own_split else None, notes=[note] if note else [])
    if data_named:
        result.sources.append(data_source(cfg.data, settings))
    if result.sources or result.validation_of is not None:
        return result
    if saved is not None:
        result.validation_of = saved
        result.notes.append("no task named: evaluating the run's validation split (perplexity:validation)")
        return result
    raise UserError(
        f"'{model_dir}' is not a run directory, so it has no validation split of its own: name what to evaluate, "
        "e.g. `data=text data.path=held_out.txt` (the perplexity of that file), "
        "`eval.tasks=[perplexity:held_out.txt,multiple_choice:hellaswag_val.jsonl]` or `harness.tasks=[TASK]`."
    )


def saved_config(model_dir: Path) -> Config | None:
    """A run dir's config.yaml (None for an export or a Hugging Face folder), read within bounds."""
    path = model_dir / CONFIG
    return read_saved(path) if os.path.lexists(path) else None


def validation_task_source(saved: Config, cfg: EvalConfig, log: Any) -> TaskSource:
    """The run's validation split (prepared again only if its cache is gone), scored with the
    command line's eval settings (stride, limit)."""
    from llmtrain.data.prepare import prepare_data

    return validation_source(prepare_data(saved.data, log=log), cfg)
