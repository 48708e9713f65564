"""A saved config read back: a run dir's config.yaml as a validated `Config`.

Every reader of a run's config (sample, export, eval, report, compare) goes through `read_saved`,
so each reads it the same way: within bounds (core/readers.py: a regular file of a config's size,
whose YAML aliases expand to no more values than a config holds), migrated from an older
llmtrain's keys, and validated; a file that is none of that is a UserError naming it.
"""

from __future__ import annotations

from pathlib import Path

from llmtrain.config.hydra import config_from_dict
from llmtrain.config.schema import Config
from llmtrain.core.errors import ConfigError, UserError
from llmtrain.core.readers import read_yaml


def read_saved(path: Path) -> Config:
    """The config at `path` (a run's config.yaml), or UserError saying why the run dir is damaged."""
    data = read_yaml(path, "the run's config")
    if not isinstance(data, dict):
        raise UserError(f"'{path}' holds no mapping of config groups; it is the config `llmtrain train` wrote, so the "
                        "run directory is damaged.")
    try:
        return config_from_dict(data)
    except ConfigError as err:
        raise UserError(f"'{path}' is not a valid llmtrain config: {err}") from None
