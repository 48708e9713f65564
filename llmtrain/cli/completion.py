"""Shell completion: Hydra's completion script calls `llmtrain -sc query=SHELL` with COMP_LINE set.

The subcommand word is ours, not Hydra's: it is completed here; the overrides after `train` are
Hydra's to complete, with the subcommand word stripped from COMP_LINE.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from llmtrain.cli.train import run_hydra, train_task


def complete(args: list[str], commands: Iterable[str]) -> None:
    """Answer one completion query (or, with no COMP_LINE, print Hydra's install script); `commands`
    are the subcommand words."""
    line = os.environ.get("COMP_LINE", "")
    words = line.split()
    if not words:  # `llmtrain -sc install=bash`: Hydra prints the script that calls us back
        run_hydra(args, train_task)
        return
    completing_command = len(words) == 1 or (len(words) == 2 and not line.endswith(" "))
    if completing_command:
        prefix = words[1] if len(words) == 2 else ""
        print(" ".join(c for c in commands if c.startswith(prefix)))
        return
    if words[1] != "train":
        return
    os.environ["COMP_LINE"] = re.sub(r"^(\s*\S+\s+)train\b", r"\1", line)
    os.environ["COMP_POINT"] = str(len(os.environ["COMP_LINE"]))
    run_hydra(args, train_task)
