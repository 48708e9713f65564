"""`llmtrain configs [GROUP | GROUP=OPTION ...] [-cd DIR]`: browse the config groups.

With no argument every group and option with its one-line description (model options with their
parameter count and context, presets with the keys they set); GROUP lists one group; GROUP=OPTION
prints that option's YAML file as shipped. The catalogue is llmtrain.config.catalog's, the same
`llmtrain train --help` lists: read from the YAML files, no Hydra, no torch.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.cli.common import check_config_dir, conf_dir, fail

if TYPE_CHECKING:
    from llmtrain.config.catalog import Group

MIN_WIDTH = 80
MODEL_NOTE = ("params: at the vocabulary shown; with model.vocab_size=null the data decides it (256 with the default "
              "byte tokenizer, 50257 with data.tokenizer=gpt2), padded to a multiple of model.vocab_multiple.")
FOOTER = ("One group: llmtrain configs GROUP. An option's YAML: llmtrain configs model=gpt_small. Keys and their "
          "defaults: llmtrain train --help. Your own options: -cd DIR (DIR/model/mine.yaml -> model=mine).")


# Sections of keys that have no options to pick (`report.enabled`, not report=OPTION).
SECTIONS_WITHOUT_OPTIONS = ("report",)


def configs_command(args: list[str]) -> None:
    """`llmtrain configs ARGS`: list the catalogue, one group, or print options' YAML."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="llmtrain configs",
        description="Browse the config groups: every group and option with a one-line description (model options "
        "with parameter count and context, presets with the keys they set); GROUP lists one group; GROUP=OPTION "
        "prints that option's YAML file.",
        epilog="examples:\n  llmtrain configs                   every group and option\n"
        "  llmtrain configs model             one group\n"
        "  llmtrain configs model=gpt_small   that option's YAML\n"
        "  llmtrain configs -cd myconf model  with your own options (myconf/model/*.yaml)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("what", nargs="*", metavar="GROUP[=OPTION]", help="a group to list, or an option to print")
    parser.add_argument("--config-dir", "-cd", default=None, help="a folder of your own group options (as for train)")
    opts = parser.parse_args(args)
    check_config_dir(opts.config_dir)

    from llmtrain.config.catalog import catalog, find_group
    from llmtrain.core.errors import UserError

    extra = Path(opts.config_dir).expanduser() if opts.config_dir else None
    width = max(MIN_WIDTH, shutil.get_terminal_size((100, 24)).columns)
    what = ""
    try:
        groups = catalog(conf_dir(), extra)
        if not opts.what:
            print(render_catalog(groups, width))
            sys.stdout.flush()  # here, where a closed pipe (`| head`) is caught, not at the interpreter's exit
            return
        picked = []  # every argument resolved before anything is printed: a bad one prints nothing
        for what in opts.what:
            group_name, has_option, option_name = what.partition("=")
            group = find_group(groups, group_name)
            picked.append((group, group.option(option_name) if has_option else None))
        for i, (group, option) in enumerate(picked):
            if option is not None:
                sys.stdout.flush()
                sys.stdout.buffer.write(option.path.read_bytes())  # the file as shipped, byte for byte
                sys.stdout.buffer.flush()
            else:
                print(("\n" if i else "") + "\n".join(render_group(group, width)))
        sys.stdout.flush()
    except UserError as err:
        name = what.partition("=")[0]
        if "Unknown config group" in str(err) and ("." in name or name in SECTIONS_WITHOUT_OPTIONS):
            fail(f"{err} '{what}' is a key or a section of keys, not a group: `llmtrain train --help` lists the keys "
                 f"(e.g. {name.split('.')[0]}.*).")
        fail(str(err))


def render_catalog(groups: list[Group], width: int) -> str:
    """Every group, then how to look closer."""
    lines = ["Config groups and their options (default marked *; pick one with GROUP=OPTION, e.g. "
             "`llmtrain train model=gpt_small`):"]
    for group in groups:
        lines += ["", *render_group(group, width)]
    lines += ["", *textwrap.wrap(FOOTER, width)]
    return "\n".join(lines)


def render_group(group: Group, width: int) -> list[str]:
    """A group's heading and one entry per option: its name (starred when the default), then its
    description, wrapped under itself."""
    from llmtrain.config.catalog import format_params

    lines = textwrap.wrap(f"{group.name}: {group.about}", width, subsequent_indent="    ", break_on_hyphens=False)
    column = 2 + max(len(o.name) + 1 for o in group.options) + 2
    for option in group.options:
        text = option.description or "(no description: the file has no header comment)"
        if option.model is not None:
            m = option.model
            text = (f"{format_params(m.params)} params (vocab {m.vocab:,}: {m.vocab_source}), "
                    f"context {m.context:,}. {text}")
        if option.sets:
            text += f" Sets {', '.join(option.sets)}."
        if option.user:
            text += f" (yours: {option.path}"
            text += "; the shipped option of this name is found first)" if option.shadowed else ")"
        name = f"  {option.name}{'*' if option.is_default else ''}"
        wrapped = textwrap.wrap(text, max(40, width - column), break_on_hyphens=False)
        lines.append(f"{name:<{column}}{wrapped[0]}")
        lines += [" " * column + line for line in wrapped[1:]]
    if group.name == "model":
        lines += textwrap.wrap(MODEL_NOTE, width, initial_indent="  ", subsequent_indent="  ")
    return lines
