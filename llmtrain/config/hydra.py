"""The Hydra boundary: registration of the schema, conversion of a composed node into a typed
`Config`, and the one-paragraph error text for what OmegaConf refuses."""

import dataclasses
import difflib
import typing
from enum import Enum
from typing import Any

from llmtrain.config.schema import GROUPS, MAPPING_KEYS, Config, ModelConfig, enum_names, field_type, schema_fields
from llmtrain.config.validate import validate
from llmtrain.core.errors import ConfigError


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore (called by the CLI only).

    One root node: its fields are the groups' dataclasses, so every group option is validated
    against its schema when Hydra merges it into that field.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="llmtrain_schema", node=Config)


def to_config(node: Any, resolve: typing.Callable[[Config], None] | None = None) -> Config:
    """Convert a composed OmegaConf node into a validated `Config`; raises `ConfigError`. `resolve`
    completes the config before it is validated (model.init_from: the folder's shape decides, e.g.,
    whether data.seq_len fits the context)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        _check_unknown_keys(node, Config, "")
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), node))
    except OmegaConfBaseException as err:
        raise ConfigError(describe_omegaconf_error(err)) from None
    assert isinstance(cfg, Config)
    if resolve is not None:
        resolve(cfg)
    validate(cfg)
    return cfg


def config_from_dict(data: dict) -> Config:
    """Rebuild a `Config` from `config_to_dict` output (e.g. a run dir's config.yaml), one written by
    an older llmtrain too (migrate_config_dict)."""
    from omegaconf import OmegaConf

    return to_config(OmegaConf.create(migrate_config_dict(data)))


def migrate_config_dict(data: Any) -> Any:
    """A saved config (config.yaml, a checkpoint's) in today's keys: `report: true` (report was a
    boolean before it had its own keys) becomes `report: {enabled: true}`, `threads: null` (what
    auto was called before it had a name) `threads: auto`, `parallel.mode` the mesh degrees of its
    preset, and `model.activation_checkpointing: true/false` full/none. A copy; anything else as it was."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    if isinstance(data.get("report"), bool):
        data["report"] = {"enabled": data["report"]}
    if "threads" in data and data["threads"] is None:
        data["threads"] = "auto"
    parallel = data.get("parallel")
    if isinstance(parallel, dict) and "mode" in parallel:  # parallel.mode before the mesh degrees
        parallel = dict(parallel)
        mode = parallel.pop("mode")
        parallel.update(DATA_PARALLEL_PRESETS.get(mode, {}))
        data["parallel"] = parallel
    if isinstance(data.get("model"), dict):
        data["model"] = migrate_model_dict(data["model"])
    return data


def migrate_model_dict(model: Any) -> Any:
    """A saved model section in today's keys: `activation_checkpointing: true/false` (a boolean before it
    had modes) becomes full/none. A copy; anything else as it was."""
    if not isinstance(model, dict) or not isinstance(model.get("activation_checkpointing"), bool):
        return model
    model = dict(model)
    model["activation_checkpointing"] = LEGACY_CHECKPOINTING[model["activation_checkpointing"]]
    return model


# model.activation_checkpointing's old boolean values as today's modes.
LEGACY_CHECKPOINTING = {True: "full", False: "none"}


# The mesh keys the data-parallel presets (conf/parallel/{ddp,zero1,fsdp}.yaml) set apart from the
# defaults: what an older llmtrain's one key, parallel.mode, reads as, and what a memory saver
# switching a one-process config to zero1 or fsdp sets (preflight/savers.py).
DATA_PARALLEL_PRESETS: dict[object, dict[str, object]] = {
    "single": {}, "ddp": {"dp_replicate": -1}, "zero1": {"dp_replicate": -1, "zero1": True}, "fsdp": {"dp_shard": -1},
}


def model_config_from_dict(data: dict) -> ModelConfig:
    """Rebuild (and type-check) a `ModelConfig`, e.g. from an export's model_config.json."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), migrate_model_dict(data)))
    except OmegaConfBaseException as err:
        raise ConfigError(describe_omegaconf_error(err)) from None


def _check_unknown_keys(node: Any, schema: type, prefix: str) -> None:
    """`+key=value` can add keys the schema doesn't know; refuse them by name."""
    from omegaconf import DictConfig, OmegaConf

    fields = schema_fields(schema)
    for key in node.keys():
        full = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(unknown_key_message(full))
        sub_schema = field_type(fields[key].type)
        if (dataclasses.is_dataclass(sub_schema) and not OmegaConf.is_missing(node, key)
                and isinstance(node[key], DictConfig)):
            _check_unknown_keys(node[key], sub_schema, f"{full}.")


# --------------------------------------------------------------------------------------------
# OmegaConf's errors, as one paragraph a user can act on
# --------------------------------------------------------------------------------------------


def describe_omegaconf_error(err: Exception) -> str:
    """Turn an OmegaConf/Hydra error into one paragraph naming the key and what is valid."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, ValidationError

    key = getattr(err, "full_key", None) or ""
    msg = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
    if isinstance(err, MissingMandatoryValue):
        return f"Missing required value '{key}': set it on the command line, e.g. {key}=<value>."
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and key:
        return unknown_key_message(key)
    if isinstance(err, ValidationError) and "subclass of ReportConfig" in msg:
        # a YAML file (-cd DIR) with the spelling from before report had keys of its own
        return ("'report' is a section of its own now, not true/false: write `report: {enabled: false}` (or "
                "report.enabled=false on the command line; `report=false` there still works), and report.console: "
                "auto|short|full for what the terminal shows.")
    if isinstance(err, ValidationError):
        described = _value_type_message(key, getattr(err, "value", None), _key_type(key))
        return described or f"Bad value{f' for {key!r}' if key else ''}: {msg.rstrip('.')}."
    return msg


def unknown_key_message(full_key: str) -> str:
    """'Unknown config key' with the valid keys of its parent section and a close match."""
    parent, _, leaf = full_key.rpartition(".")
    if parent in MAPPING_KEYS:
        return _mapping_key_message(full_key, parent)
    found = _schema_for_key(full_key)
    fields = list(schema_fields(found[0])) if found else []
    close = _close_key(full_key)
    hint = f" Did you mean '{close}'?" if close else ""
    if full_key == "parallel.mode":  # an older llmtrain's one key: its options are the presets now
        hint = (f" It was replaced by the mesh degrees; its options are presets: parallel="
                f"{'|'.join(str(mode) for mode in DATA_PARALLEL_PRESETS)} (e.g. parallel=fsdp).")
    where = f"under '{parent}'" if parent else "at the top level"
    valid = f" Valid keys {where}: {', '.join(fields)}." if fields else ""
    return f"Unknown config key '{full_key}'.{hint}{valid}"


def closest_key(key: str) -> str | None:
    """The config key a user most likely meant by `key` (typed as `--key`, or without its '='): `key`
    itself when it is one (hydra.* keys included), else the close match an unknown key gets; None when
    nothing is close."""
    parent, _, leaf = key.rpartition(".")
    found = _schema_for_key(key)
    if key.startswith("hydra.") or (found and found[1] in schema_fields(found[0])):
        return key
    if parent in MAPPING_KEYS and leaf in MAPPING_KEYS[parent]:
        return key
    return _close_key(key)


def _close_key(full_key: str) -> str | None:
    """The key meant by an unknown one: `lr` -> optim.lr (an exact key of a group beats a fuzzy
    top-level match), `max_step` -> max_steps (difflib, within the same section); None if none is close."""
    parent, _, leaf = full_key.rpartition(".")
    if parent in MAPPING_KEYS:
        close = difflib.get_close_matches(leaf, MAPPING_KEYS[parent], n=1)
        return f"{parent}.{close[0]}" if close else None
    if not parent:
        nested = [f"{g}.{leaf}" for g in GROUPS if leaf in schema_fields(field_type(schema_fields(Config)[g].type))]
        if nested:
            return nested[0]
    found = _schema_for_key(full_key)
    close = difflib.get_close_matches(leaf, list(schema_fields(found[0])), n=1) if found else []
    return f"{parent + '.' if parent else ''}{close[0]}" if close else None


def takes_list(key: str) -> bool:
    """Whether the schema's `key` holds a list (data.seq_len_schedule, eval.tasks): there `key=[a,b]`
    is one value, where a bare comma list is a sweep."""
    typed = _key_type(key)
    return typed is not None and typing.get_origin(typed[0]) is list


def _mapping_key_message(full_key: str, mapping: str) -> str:
    """An unknown key inside a name-keyed mapping (`monitor.actions.<alarm>`): a typo gets the close
    match and the valid names; a valid name not yet in the mapping needs Hydra's '+' to be added."""
    leaf = full_key[len(mapping) + 1:]
    names = MAPPING_KEYS[mapping]
    adding = f"a name not yet in '{mapping}' is added with '+': '+{mapping}.<name>=...'"
    if leaf in names:
        return (f"Unknown config key '{full_key}': '{leaf}' is a valid name, but '{mapping}' has no entry for it yet, "
                f"and Hydra adds a key only with '+': use '+{full_key}=...'.")
    close = _close_key(full_key)
    hint = f" Did you mean '{close}'?" if close else ""
    return f"Unknown config key '{full_key}'.{hint} Valid names under '{mapping}': {', '.join(names)} ({adding})."


def _schema_for_key(full_key: str) -> tuple[type, str] | None:
    """(the section dataclass that holds a dotted key, the key's last part); None where a part on the
    way is not a section (an unknown group, a scalar)."""
    parts = full_key.split(".")
    schema: type = Config
    for part in parts[:-1]:
        fld = schema_fields(schema).get(part)
        sub = field_type(fld.type) if fld else None
        if not (isinstance(sub, type) and dataclasses.is_dataclass(sub)):
            return None
        schema = sub
    return schema, parts[-1]


def _key_type(full_key: str) -> tuple[Any, bool, Any] | None:
    """(concrete type, accepts null, schema default) of a scalar key, including a mapping's values
    (`monitor.actions.<alarm>`); None for keys it cannot place (list items, unknown keys)."""
    parent, _, leaf = full_key.rpartition(".")
    if parent in MAPPING_KEYS:
        found = _schema_for_key(parent)
        if found is None:
            return None
        value_type = typing.get_args(schema_fields(found[0])[found[1]].type)[-1]
        return value_type, False, None
    found = _schema_for_key(full_key)
    fld = schema_fields(found[0]).get(found[1]) if found else None
    if fld is None:
        return None
    optional = type(None) in typing.get_args(fld.type)
    default = fld.default if fld.default is not dataclasses.MISSING else None
    return field_type(fld.type), optional, default.value if isinstance(default, Enum) else default


def _value_type_message(key: str, value: Any, typed: tuple[Any, bool, Any] | None) -> str | None:
    """'<key>' is <the value seen>; what this key takes (the valid names of an enum, with a close
    match), with an example. None where the key's type is not a scalar this knows how to explain."""
    if key.endswith("]"):  # an item of a list, `data.seq_len_schedule[0]`: say it of the list
        base, _, index = key[:-1].partition("[")
        typed = _key_type(base)
        if typed is None or typing.get_origin(typed[0]) is not list:
            return None
        return (f"'{base}' has {_shown(value)} at index {index}; expected a list in brackets, of "
                f"{_list_items(typed[0])}, e.g. {base}={_LIST_EXAMPLES.get(base, '[]')}.")
    if typed is None:
        return None
    tp, optional, default = typed
    seen = f"'{key}' is {_shown(value)}"
    or_null = " or null" if optional else ""
    example = f", e.g. {key}={_shown(default).strip(chr(39))}" if default is not None else ""
    names = enum_names(tp)
    if key == "model.activation_checkpointing" and isinstance(value, bool):  # its spelling before it had modes
        return (f"{seen}, but it takes a mode now, not true/false: none (what false meant), full (what true meant: "
                f"each checkpointed block keeps only its input and is recomputed whole in backward) or op (it keeps "
                f"the matmul and attention outputs and recomputes the elementwise ops), e.g. "
                f"{key}={LEGACY_CHECKPOINTING[value]}; model.checkpoint_every=k checkpoints every k-th block.")
    if names:
        close = difflib.get_close_matches(str(value), names, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        return f"{seen}; valid: {', '.join(names)}{or_null}.{hint}"
    if tp is bool:
        return f"{seen}; expected a boolean: true or false{or_null}."
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            # `max_steps=1e3` parses as the float 1000.0, which an integer key refuses
            return (f"{seen}, a float (written with a decimal point or an exponent); expected an integer{or_null}: "
                    f"write it as {key}={int(value)}.")
        return f"{seen}; expected an integer (a whole number){or_null}{example}."
    if tp is float:
        return f"{seen}; expected a number (e.g. 0.5 or 3e-4){or_null}{example}."
    if tp is str:
        return f"{seen}; expected a string (a single value, not a list or mapping){or_null}{example}."
    if typing.get_origin(tp) is list:
        return (f"{seen}; expected a list in brackets, of {_list_items(tp)}{or_null}, "
                f"e.g. {key}={_LIST_EXAMPLES.get(key, '[]')}.")
    if typing.get_origin(tp) is dict:
        return f"{seen}; expected a mapping of names to values; set one entry at a time: '+{key}.<name>=<value>'."
    return None


def _shown(value: Any) -> str:
    """A value as the user wrote it: strings quoted, YAML's spelling for booleans and null."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return f"'{value}'" if isinstance(value, str) else str(value)


def _list_items(tp: Any) -> str:
    """What the items of a list type are, in words: `list[list[int]]` -> 'lists of integers'."""
    item = typing.get_args(tp)[0]
    if typing.get_origin(item) is list:
        return "lists of integers"
    return "strings" if item is str else "integers"


# An example value for each list key, shown when a list item has the wrong type.
_LIST_EXAMPLES = {"data.seq_len_schedule": "[[0,128],[1000,256]]",
                  "eval.tasks": "[perplexity:held_out.txt,multiple_choice:hellaswag_val.jsonl]"}


def command_line_of_this_run() -> tuple[list[str] | None, str | None]:
    """The overrides and --config-dir of the `llmtrain train` command that started this run, from
    Hydra's record of the job; (None, None) for a config built in code (no Hydra job)."""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return None, None
    if not HydraConfig.initialized():
        return None, None
    hydra = HydraConfig.get()
    extra = [s.path for s in hydra.runtime.config_sources if "command-line" in s.provider and s.schema == "file"]
    return list(hydra.overrides.task), extra[0] if extra else None
