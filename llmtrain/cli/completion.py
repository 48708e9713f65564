"""Shell completion: Hydra's completion script calls `llmtrain -sc query=SHELL` with COMP_LINE set.

The subcommand word is ours, not Hydra's: it is completed here, and so are the arguments of
`configs` (groups and GROUP=OPTION, from llmtrain.config.catalog); the overrides after `train` are
Hydra's to complete, with the subcommand word stripped from COMP_LINE. Hydra (and, through
llmtrain.cli.train, torch) is imported only for what Hydra answers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable


def complete(args: list[str], commands: Iterable[str]) -> None:
    """Answer one completion query (or, with no COMP_LINE, print Hydra's install script); `commands`
    are the subcommand words."""
    line = os.environ.get("COMP_LINE", "")
    words = line.split()
    if not words:  # `llmtrain -sc install=bash`: Hydra prints the script that calls us back
        _hydra(args)
        return
    completing_command = len(words) == 1 or (len(words) == 2 and not line.endswith(" "))
    if completing_command:
        prefix = words[1] if len(words) == 2 else ""
        print(" ".join(c for c in commands if c.startswith(prefix)))
        return
    if words[1] == "configs":
        done, prefix = (words[2:], "") if line.endswith(" ") else (words[2:-1], words[-1])
        if done[-1:] not in (["-cd"], ["--config-dir"]):  # after -cd: nothing, so the shell completes a folder
            print(" ".join(c for c in configs_words(done) if c.startswith(prefix)))
        return
    if words[1] != "train":
        return
    os.environ["COMP_LINE"] = re.sub(r"^(\s*\S+\s+)train\b", r"\1", line)
    os.environ["COMP_POINT"] = str(len(os.environ["COMP_LINE"]))
    _hydra(args)


def configs_words(typed: list[str]) -> list[str]:
    """What `llmtrain configs` takes: every group and every GROUP=OPTION (with the options of a
    `-cd DIR` already typed), and the -cd flag."""
    from pathlib import Path

    from llmtrain.cli.common import conf_dir
    from llmtrain.config.catalog import catalog

    extra = None
    for flag, value in zip(typed, typed[1:]):
        if flag in ("-cd", "--config-dir") and Path(value).expanduser().is_dir():
            extra = Path(value).expanduser()
    groups = catalog(conf_dir(), extra)
    words = [g.name for g in groups]
    words += [f"{g.name}={o.name}" for g in groups for o in g.options if not o.shadowed]
    return [*words, "--config-dir", "-cd"]


def _hydra(args: list[str]) -> None:
    from llmtrain.cli.train import run_hydra, train_task

    run_hydra(args, train_task)
