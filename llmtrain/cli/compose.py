"""Composing a config the way `llmtrain train` would, without starting a run: the shipped groups
plus `--config-dir`, the command line's overrides, every job of a sweep, and Hydra's and
OmegaConf's errors turned into one paragraph each (ConfigError, exit 2 in the CLI).

`prepare`, `check` and `doctor` compose their config here (`compose_config`); `train` checks every
job here (`validate_overrides`: composed, its corpus found, a data=hf dataset loaded, the pre-flight
check passed) before Hydra creates the first run dir.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.cli.common import conf_dir

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

    from llmtrain.config.schema import Config


def validate_overrides(
    overrides: list[str], multirun: bool = False, extra_dir: str | None = None, config_name: str | None = None,
    preflight: bool = False,
) -> None:
    """Compose every configuration the command line asks for and validate it; raises ConfigError,
    or CheckFailed (after printing the check's FAIL rows) when `preflight` finds any.

    A sweep (`-m a=1,2 b=x,y`) is expanded the way Hydra's basic sweeper does, so a bad value in
    any job fails before the first job starts. `extra_dir` is `--config-dir`: searched like Hydra does.
    """
    from llmtrain.data.corpus import input_files

    jobs = _expand_sweep(overrides) if multirun else [overrides]
    for job in jobs:
        cfg = compose_config(job, extra_dir, config_name)
        if cfg.data.path is not None and cfg.data.source.value in ("text", "jsonl"):
            input_files(cfg.data.path, cfg.data.source.value)  # a missing corpus fails now, before any run dir
        if cfg.data.source.value == "hf":
            from llmtrain.data.cache import hf_dataset

            hf_dataset(cfg.data)  # loaded (or refused) now, before any run dir; the run reuses it
        if preflight:
            from llmtrain.preflight.check import CheckFailed, run_check
            from llmtrain.preflight.render import check_command_line, render_refusal

            if cfg.memory_saver:  # the check judges the config train will run: with the preset's saver applied
                from llmtrain.preflight.savers import apply_memory_saver

                cfg = apply_memory_saver(cfg)[0]
            report = run_check(cfg, measure_compute=False)
            if report.failures and not cfg.allow_check_failures:
                from llmtrain.core.console import default_console

                render_refusal(report, default_console(stderr=True), check_command_line(job, extra_dir))
                raise CheckFailed(report.refusal(), report)


# Keys that became sections: the old spelling `KEY=VALUE` on the command line means `NEW=VALUE`.
RENAMED_OVERRIDES = {"report": "report.enabled"}


def upgrade_overrides(args: list[str]) -> list[str]:
    """The command line with the old spellings rewritten before Hydra sees them: `report=false`
    (report was a boolean before it had its own keys) is `report.enabled=false`, a sweep
    `report=true,false` likewise. Everything else, flags included, is passed as it was. Every
    command that composes a config goes through here (compose_config; train for Hydra's own parse)."""
    upgraded = []
    for arg in args:
        key, equals, value = arg.partition("=")
        if equals and key in RENAMED_OVERRIDES and not value.lstrip().startswith("{"):
            arg = f"{RENAMED_OVERRIDES[key]}={value}"
        upgraded.append(arg)
    return upgraded


def compose_config(overrides: list[str], extra_dir: str | None = None, config_name: str | None = None) -> Config:
    """Compose the shipped config (plus `extra_dir`, like --config-dir) with `overrides` and validate
    it, without starting Hydra's job machinery (no run dir); raises ConfigError."""
    overrides = upgrade_overrides(overrides)
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from llmtrain.config.hydra import register_configs, to_config
    from llmtrain.core.errors import ConfigError

    parse_overrides(overrides)  # a word Hydra cannot read, or a sweep without -m: one paragraph that says what to write
    register_configs()
    search = [f"hydra.searchpath=[file://{Path(extra_dir).expanduser().resolve()}]"] if extra_dir else []
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="train"):
        try:
            node = compose(config_name=config_name or "config", overrides=[*search, *overrides])
        except Exception as err:  # Hydra wraps the cause; turn it into one paragraph
            raise _composition_error(err) from None
    try:
        return to_config(node, resolve=lambda cfg: _init_from(cfg, overrides))
    except ConfigError as err:
        if "Unknown config key" in str(err) and any(o.startswith("+") for o in overrides):
            raise ConfigError(f"{err} ('+key=value' cannot add keys the schema does not define.)") from None
        raise


def _init_from(cfg: Config, overrides: list[str]) -> None:
    """model.init_from=FOLDER: the config takes the folder's shape and tokenizer before it is
    validated, and every key the overrides set must agree with the folder (torch, which reading the
    folder needs, is imported only then)."""
    if cfg.model.init_from is not None:
        from llmtrain.hf.init import apply_init_from, explicit_keys

        apply_init_from(cfg, explicit_keys(overrides))


def _expand_sweep(overrides: list[str]) -> list[list[str]]:
    """The jobs of a basic sweep. Sweeps only a sweeper plugin can expand (interval(), glob()
    without a config loader) keep their key at its composed default here, and are validated by
    each job instead."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.types import Glob

    parsed = parse_overrides(overrides, multirun=True)
    expandable = [
        o for o in parsed if not o.is_sweep_override() or (o.is_discrete_sweep() and not isinstance(o.value(), Glob))
    ]
    try:
        batches = BasicSweeper.split_arguments(expandable, None)
    except Exception as err:
        raise _composition_error(err) from None
    return [list(job) for batch in batches for job in batch]


def parse_overrides(overrides: list[str], multirun: bool = False) -> list[Override]:
    """The overrides as Hydra's grammar reads them; ConfigError for a word it cannot read (`max_steps 30`,
    `max_steps=30,`) and, without `multirun`, for a sweep (a comma list, range(), ...), which Hydra
    refuses outside -m with advice meant for other keys: each says what to write instead."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from llmtrain.core.errors import ConfigError

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as err:
        raise ConfigError(_unreadable_override(err.override, overrides, err)) from None
    for override in parsed:
        if override.is_sweep_override() and not multirun:
            raise ConfigError(_sweep_without_multirun(override))
    return parsed


# A value holding one of these is a list, a mapping, a function or a quoted string: its commas are
# not split here.
_STRUCTURED = frozenset("[]{}()'\"")
_SYNTAX = "llmtrain takes config values as key=value overrides, each one word with no spaces around '='"


def _unreadable_override(word: str, overrides: list[str], err: Exception) -> str:
    """Why Hydra cannot read `word`, one of `overrides`, and the override that was meant."""
    at = overrides.index(word) if word in overrides else len(overrides)
    before, after = overrides[:at], overrides[at + 1:]
    key, equals, value = word.partition("=")
    if not equals and before[-1:] and before[-1].endswith("=") and before[-1].count("=") == 1:
        return f"'{before[-1]} {word}' has a space after '=': {_SYNTAX}: write {before[-1]}{word}."
    if not equals:
        return _without_equals(word, after)
    items = value.split(",")
    kept = [item for item in items if item]
    if len(items) > 1 and kept and len(kept) < len(items) and not _STRUCTURED & set(value):  # `max_steps=30,`
        if len(kept) == 1:
            return (f"'{word}' ends with a comma: write {key}={kept[0]}. (A comma list is a sweep, one job per value, "
                    f"and runs with -m: `llmtrain train -m {key}={kept[0]},<another value>`.)")
        return (f"'{word}' has an empty item in its comma list: give one value, e.g. {key}={kept[0]}, or run one "
                f"job per value with -m: `llmtrain train -m {key}={','.join(kept)}`.")
    return f"Cannot parse the command-line override: {' '.join(str(err).split())}"


def _without_equals(word: str, after: list[str]) -> str:
    """A word with no '=': `max_steps 30`, `max_steps = 30`, `max_steps =30` (the key, with a close
    match when mistyped, and the value that follows), or a group's option alone (`gpt_small`)."""
    from llmtrain.config.hydra import closest_key
    from llmtrain.config.schema import MAPPING_KEYS

    following = after[1] if after[:1] == ["="] and len(after) > 1 else after[0].lstrip("=") if after else ""
    value = following if following and "=" not in following else "<value>"
    bare = word.lstrip("+")
    meant = closest_key(bare)
    if meant is not None:
        typo = "" if meant == bare else f" ('{bare}' is no config key; {meant} is the closest)"
        # '+' adds mapping entries only
        plus = word[:len(word) - len(bare)] if meant.rpartition(".")[0] in MAPPING_KEYS else ""
        return f"'{word}' is not an override: {_SYNTAX}: write {plus}{meant}={value}{typo}."
    groups = sorted(path.parent.name for path in conf_dir().glob(f"*/{word}.yaml"))
    if groups:
        return f"'{word}' is not an override: {_SYNTAX}. Did you mean {groups[0]}={word}?"
    return (f"'{word}' is not an override: {_SYNTAX}, e.g. max_steps=30 or model=gpt_small (`llmtrain configs` "
            "lists the groups, `llmtrain train --help` the keys).")


def _sweep_without_multirun(override: Override) -> str:
    """A sweep outside -m: which command runs it, the single value that runs one job, and, only where
    the key holds a list, how to set the list itself."""
    from hydra.core.override_parser.types import ValueType

    from llmtrain.config.hydra import takes_list

    line, key = override.input_line, override.key_or_group
    written_key, _, raw = line.partition("=")
    comma_list = override.value_type is ValueType.SIMPLE_CHOICE_SWEEP
    if override.is_discrete_sweep():  # the first value as typed (1e-3, not 0.001) where it is plain
        first = (raw.split(",")[0] if comma_list and not _STRUCTURED & set(raw)
                 else next(override.sweep_string_iterator()))
        one = f"give one value, e.g. {written_key}={first}"
    else:
        one = "give one value"
    kind = "a comma list of values" if comma_list else raw.partition("(")[0] + "()"
    message = (f"'{line}' is a sweep ({kind}), which runs one job per value and needs -m: "
               f"`llmtrain train -m {line}`; for one run, {one}.")
    if comma_list and (takes_list(key) or key in _list_groups()):
        message += f" To set '{key}' to the list itself, put it in brackets and quote it: '{written_key}=[{raw}]'."
    return message


def _list_groups() -> set[str]:
    """The groups that take a list of options (preset=[stable,fast]): those whose default in
    conf/config.yaml is a list."""
    import yaml

    defaults = yaml.safe_load((conf_dir() / "config.yaml").read_text())["defaults"]
    return {key for entry in defaults if isinstance(entry, dict)
            for key, value in entry.items() if isinstance(value, list)}


# Hydra config names that only a plugin provides -> (the plugin, the llmtrain extra that installs it).
PLUGIN_EXTRAS = {
    "hydra/sweeper/optuna": ("Hydra's Optuna sweeper plugin", "optuna"),
    "hydra/launcher/submitit_slurm": ("Hydra's submitit launcher plugin", "slurm"),
    "hydra/launcher/submitit_local": ("Hydra's submitit launcher plugin", "slurm"),
}


def _composition_error(err: Exception) -> Exception:
    from hydra.errors import MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    from llmtrain.config.hydra import describe_omegaconf_error
    from llmtrain.core.errors import ConfigError

    if isinstance(err, MissingConfigException):
        missing = err.missing_cfg_file or ""
        group, _, option = missing.rpartition("/")
        if missing in PLUGIN_EXTRAS:  # a shipped option that stands on a Hydra plugin not installed
            plugin, extra = PLUGIN_EXTRAS[missing]
            return ConfigError(f"Hydra could not load '{missing}': it comes with {plugin}, which is not installed "
                               f"here. Install it with pip install 'llmtrain[{extra}]' (or every extra: '.[dev]').")
        if err.options and group:
            options = sorted(err.options)
            close = difflib.get_close_matches(option, options, n=1)  # as an unknown key gets its close match
            hint = f" Did you mean {group}={close[0]}?" if close else ""
            example = "" if close else f" (e.g. {group}={options[0]})"
            return ConfigError(
                f"Unknown option '{option}' for config group '{group}'.{hint} "
                f"Valid options: {', '.join(options)}{example}."
            )
        return ConfigError(" ".join(str(err).split()))
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, OmegaConfBaseException):
            return ConfigError(describe_omegaconf_error(cause))
        cause = cause.__cause__ or cause.__context__
    return ConfigError(" ".join(str(err).split()))
