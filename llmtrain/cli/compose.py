"""Composing a config the way `llmtrain train` would, without starting a run: the shipped groups
plus `--config-dir`, the command line's overrides, every job of a sweep, and Hydra's and
OmegaConf's errors turned into one paragraph each (ConfigError, exit 2 in the CLI).

`prepare`, `check` and `doctor` compose their config here (`compose_config`); `train` checks every
job here (`validate_overrides`: composed, its corpus found, a data=hf dataset loaded, the pre-flight
check passed) before Hydra creates the first run dir.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.cli.common import conf_dir

if TYPE_CHECKING:
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
            from llmtrain.data.prepare import hf_dataset

            hf_dataset(cfg.data)  # loaded (or refused) now, before any run dir; the run reuses it
        if preflight:
            from llmtrain.preflight.check import CheckFailed, check_command_line, render_refusal, run_check

            report = run_check(cfg, measure_compute=False)
            if report.failures and not cfg.allow_check_failures:
                from llmtrain.sinks import default_console

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
    from llmtrain.errors import ConfigError

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
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as err:
        raise _composition_error(err) from None
    expandable = [
        o for o in parsed if not o.is_sweep_override() or (o.is_discrete_sweep() and not isinstance(o.value(), Glob))
    ]
    try:
        batches = BasicSweeper.split_arguments(expandable, None)
    except Exception as err:
        raise _composition_error(err) from None
    return [list(job) for batch in batches for job in batch]


def _composition_error(err: Exception) -> Exception:
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    from llmtrain.config.hydra import describe_omegaconf_error
    from llmtrain.errors import ConfigError

    if isinstance(err, MissingConfigException):
        missing = err.missing_cfg_file or ""
        group, _, option = missing.rpartition("/")
        if err.options and group:
            return ConfigError(
                f"Unknown option '{option}' for config group '{group}'. Valid options: {', '.join(sorted(err.options))} "
                f"(e.g. {group}={sorted(err.options)[0]})."
            )
        return ConfigError(" ".join(str(err).split()))
    if isinstance(err, OverrideParseException):
        return ConfigError(f"Cannot parse the command-line override: {' '.join(str(err).split())}")
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, OmegaConfBaseException):
            return ConfigError(describe_omegaconf_error(cause))
        cause = cause.__cause__ or cause.__context__
    return ConfigError(" ".join(str(err).split()))
