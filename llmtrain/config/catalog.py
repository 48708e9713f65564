"""The catalogue of config groups: every group, its options (the shipped ones in conf/ and a user's
own from --config-dir), the default of each, a one-line description from each option's YAML, and
for model options the parameter count and context; for presets, the keys they set.

One source for `llmtrain train --help` (group and option names) and `llmtrain configs` (the whole
catalogue). Read straight from the YAML files, without Hydra or torch, so both answer at once: the
parameter count is a formula over the model's shape (held equal to GPT's own count by the tests).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmtrain.config.schema import GROUPS, Config, ModelConfig, config_to_dict, field_type, schema_fields
from llmtrain.core.errors import ConfigError

# Hydra's own groups that llmtrain ships options for; their default is Hydra's built-in `basic`,
# which has no file here. hydra/job_logging is llmtrain's plumbing (console.yaml), not a choice.
HYDRA_GROUPS = {
    "hydra/launcher": "Where the jobs of a sweep (-m) run; default: Hydra's basic launcher (one after another, here).",
    "hydra/sweeper": "How a sweep (-m) picks its jobs; default: Hydra's basic sweeper (every combination listed).",
}
PRESET_NOTE = ("Checklist items switched on across groups: any number, applied in order and before command-line "
               "overrides (preset=[stable,fast]); none by default.")

# The byte tokenizer of the default data (data=python_stdlib) fixes 256 ids; GPT-2's BPE 50257.
DEFAULT_DATA_VOCAB = (256, "bytes")
GPT2_VOCAB = (50257, "GPT-2")


@dataclass(frozen=True)
class ModelFacts:
    """What a model option costs: its parameters at `vocab` ids (`vocab_source` says whose
    vocabulary that is: the option's own model.vocab_size, or the data it is meant for), and its context."""

    params: int
    vocab: int
    vocab_source: str
    context: int


@dataclass(frozen=True)
class Option:
    group: str
    name: str
    path: Path
    description: str
    is_default: bool
    user: bool  # from --config-dir
    shadowed: bool = False  # a user option named like a shipped one: the shipped one is found first
    model: ModelFacts | None = None
    sets: tuple[str, ...] = ()  # preset: the keys it sets, as key=value


@dataclass(frozen=True)
class Group:
    name: str
    about: str
    default: str | None  # None: no file of this folder is picked by default
    options: tuple[Option, ...]

    def option(self, name: str) -> Option:
        """The option called `name`; ConfigError with the valid options (and a close match) if none is."""
        for option in self.options:
            if option.name == name and not option.shadowed:
                return option
        names = [o.name for o in self.options if not o.shadowed]
        example = self.default or names[0]
        raise ConfigError(f"Unknown option '{name}' for config group '{self.name}'.{close_match(name, names)} "
                          f"Valid options: {', '.join(names)} (e.g. `llmtrain configs {self.name}={example}`).")


def close_match(word: str, choices: list[str]) -> str:
    """' Did you mean 'x'?' for the closest of `choices` (difflib, as unknown keys get), or ''."""
    found = difflib.get_close_matches(word, choices, n=1)
    return f" Did you mean '{found[0]}'?" if found else ""


def catalog(root: Path, extra_dir: Path | None = None) -> list[Group]:
    """Every group: the schema's (in its order), then preset and Hydra's launcher and sweeper.
    `root` is the shipped conf/, `extra_dir` the user's --config-dir (its options are added)."""
    defaults = group_defaults(root)
    about = {name: schema_fields(Config)[name].metadata.get("help", "") for name in GROUPS}
    about.update({"preset": PRESET_NOTE, **HYDRA_GROUPS})
    groups = []
    for group in (*GROUPS, "preset", *HYDRA_GROUPS):
        default = defaults.get(group)
        shipped = [_option(group, path, path.stem == default, user=False) for path in _yaml_files(root / group)]
        names = {o.name for o in shipped}
        own = [] if extra_dir is None else [
            _option(group, path, False, user=True, shadowed=path.stem in names)
            for path in _yaml_files(extra_dir / group)
        ]
        if shipped or own:  # a section of the schema without a conf/ folder is no group to pick from
            groups.append(Group(group, about[group], default if default in names else None, (*shipped, *own)))
    return groups


def find_group(groups: list[Group], name: str) -> Group:
    """The group called `name`; ConfigError with the valid groups (and a close match) if none is."""
    for group in groups:
        if group.name == name:
            return group
    names = [g.name for g in groups]
    raise ConfigError(f"Unknown config group '{name}'.{close_match(name, names)} Valid groups: {', '.join(names)} "
                      "(e.g. `llmtrain configs model`).")


def group_defaults(root: Path) -> dict[str, str]:
    """The option conf/config.yaml's defaults list picks per group (presets: none)."""
    picked: dict[str, str] = {}
    for entry in yaml.safe_load((root / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict):
            picked.update({k: v for k, v in entry.items() if isinstance(v, str) and not k.startswith("override ")})
    return picked


def _yaml_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.yaml")) if folder.is_dir() else []


def _option(group: str, path: Path, is_default: bool, user: bool, shadowed: bool = False) -> Option:
    text = path.read_text(errors="replace")
    try:
        values = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:  # a user's file: listed with the problem; Hydra refuses it when picked
        problem = " ".join(str(err).split())
        return Option(group, path.stem, path, f"(not valid YAML: {problem})", is_default, user, shadowed)
    values = values if isinstance(values, dict) else {}
    try:
        model = _model_facts(values, path.stem) if group == "model" else None
    except (KeyError, TypeError, ValueError, ZeroDivisionError):  # a shape the schema would refuse: no count
        model = None
    sets = tuple(f"{key}={_yaml_scalar(value)}" for key, value in _flatten(values)) if group == "preset" else ()
    return Option(group, path.stem, path, description(text, path.stem, group), is_default, user, shadowed, model, sets)


# --- descriptions: the first sentence of the header comment -----------------------------------

# A sentence ends at a full stop followed by a space or the end, not at "e.g." / "i.e." or "0.02".
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)\.(?=\s|$)")


def description(text: str, name: str = "", group: str = "") -> str:
    """The first sentence of a YAML file's header comment (its leading `#` lines, a `# @package`
    line skipped, up to an indented example line or a blank comment line), without a leading
    `preset=stable:`-style label; '' for a file without one."""
    lines: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        body = line[1:]
        if body.strip().startswith("@package"):
            continue
        if not body.strip() or body.startswith("   "):  # a blank comment line or an example command: the prose ended
            if lines:
                break
            continue
        lines.append(body.strip())
    prose = " ".join(lines)
    label = re.match(rf"{re.escape(group)}={re.escape(name)}:\s*", prose) if name else None
    if label:  # "preset=stable: the pre-flight ..." -> "The pre-flight ..."
        prose = prose[label.end():][:1].upper() + prose[label.end() + 1:]
    end = _SENTENCE_END.search(prose)
    return prose[: end.end()] if end else prose


# --- presets: the keys they set --------------------------------------------------------------


def _flatten(values: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in values.items():
        if key == "defaults":
            continue
        if isinstance(value, dict) and value:
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _yaml_scalar(value: Any) -> str:
    """A value as the command line writes it (true, null, 0.05, [a,b])."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(_yaml_scalar(v) for v in value) + "]"
    return str(value)


# --- model options: parameters and context ----------------------------------------------------


def _model_facts(values: dict, name: str) -> ModelFacts:
    """Parameters and context of a model option: its YAML over the schema's defaults, as Hydra
    composes it. The vocabulary is the option's model.vocab_size when set; else the data's, which
    is not known here: GPT-2's (50257) for options named after GPT-2 (their header says they take
    data.tokenizer=gpt2), the default data's 256 bytes otherwise; padded to model.vocab_multiple."""
    shape = {**config_to_dict(ModelConfig()), **{k: v for k, v in values.items() if k != "defaults"}}
    if shape.get("vocab_size") is not None:
        vocab, source = int(shape["vocab_size"]), "model.vocab_size"
    else:
        data_vocab, source = GPT2_VOCAB if str(shape.get("name", name)).startswith("gpt2") else DEFAULT_DATA_VOCAB
        multiple = int(shape.get("vocab_multiple") or 1)
        vocab = -(-data_vocab // multiple) * multiple
        if vocab != data_vocab:
            source = f"{source}, padded to a multiple of {multiple}"
    return ModelFacts(model_params(shape, vocab), vocab, source, int(shape["block_size"]))


def model_params(shape: dict, vocab: int) -> int:
    """Unique parameters (a tied head once) of llmtrain.model.GPT with this shape (a ModelConfig as a
    plain dict, enums as their values) and `vocab` ids: the modules it builds, counted by hand."""
    C, L = int(shape["n_embd"]), int(shape["n_layer"])
    heads = int(shape["n_head"])
    kv = int(shape.get("n_kv_head") or heads)
    head_dim = C // heads
    bias = bool(shape["bias"])
    rms = shape["norm"] == "rmsnorm"
    norm = C if rms else C + (C if bias else 0)  # nn.RMSNorm has a weight only; LayerNorm a bias too when bias
    hidden = mlp_hidden(shape)
    qkv_out = (heads + 2 * kv) * head_dim
    attention = C * qkv_out + C * C + ((qkv_out + C) if bias else 0)
    gated = shape["mlp"] == "swiglu"
    mlp = (3 if gated else 2) * C * hidden + (((2 if gated else 1) * hidden + C) if bias else 0)
    block = 2 * norm + attention + mlp
    total = vocab * C + L * block  # token embedding + blocks
    if shape["position"] == "learned":
        total += int(shape["block_size"]) * C
    if shape["norm_position"] == "pre":  # pre-LN: a final norm before the head
        total += norm
    if not shape["tie_weights"]:
        total += vocab * C
    return total


def mlp_hidden(shape: dict) -> int:
    """The MLP's hidden width (as llmtrain.model.mlp_width): intermediate_size, else mlp_ratio x
    n_embd (swiglu: 2/3 of it, rounded up to a multiple of 8)."""
    if shape.get("intermediate_size") is not None:
        return int(shape["intermediate_size"])
    hidden = int(float(shape["mlp_ratio"]) * int(shape["n_embd"]))
    return 8 * math.ceil(2 * hidden / 3 / 8) if shape["mlp"] == "swiglu" else hidden


def format_params(n: int) -> str:
    """830,848 -> '0.83M', 85,192,704 -> '85.2M'."""
    return f"{n / 1e6:.2f}M" if n < 10e6 else f"{n / 1e6:.1f}M"


def schema_keys() -> list[tuple[str, str, str]]:
    """Every key of the schema as (dotted name, its default as text, its one-line help)."""
    rows: list[tuple[str, str, str]] = []

    def walk(schema: type, prefix: str, values: dict) -> None:
        for name, fld in schema_fields(schema).items():
            tp = field_type(fld.type)
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.", values[name])
                continue
            value = values[name]
            rows.append((prefix + name, "null" if value is None else str(value), fld.metadata.get("help", "")))

    walk(Config, "", config_to_dict(Config()))
    return rows
