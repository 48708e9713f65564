"""`llmtrain export RUN_DIR --format hf`: a folder transformers loads with no llmtrain code.

`AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)` read it:
config.json (GPT2LMHeadModel or LlamaForCausalLM, layouts.hf_config), model.safetensors under HF's
tensor names (the tied head left out, as transformers saves it), generation_config.json and the
tokenizer files (tokenizer_files.py). Everything is checked and built in memory first (a model with
no HF equivalent is refused before a byte is written).

Both export formats (this one and llmtrain's own, llmtrain/runs/export.py) go to their folder
through the same two steps here: `check_target` (a new or empty folder, or a previous export of
either format; anything else is the user's and is refused untouched) and `write_export` (written
into a hidden folder beside the target and renamed into place at the end, so an interrupted export
never leaves a half folder).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmtrain.core.atomic import aside, swap_folder
from llmtrain.core.errors import UserError
from llmtrain.core.hf_files import CONFIG, GENERATION_CONFIG, WEIGHTS
from llmtrain.core.readers import UnreadableFile, read_json
from llmtrain.hf import layouts
from llmtrain.hf.tokenizer_files import SPECIAL_TOKENS_MAP, TOKENIZER, TOKENIZER_CONFIG, HFTokenizer, tokenizer_files

# A peft adapter folder's two files (`export --format peft`, hf/peft_export.py).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Every file any export format writes: a folder holding only these, with an export's mark, is a
# previous export, safe to replace.
EXPORT_FILES = frozenset({CONFIG, WEIGHTS, GENERATION_CONFIG, TOKENIZER, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP,
                          "model_config.json", ADAPTER_CONFIG, ADAPTER_WEIGHTS})
# The key of config.json that marks a folder this exporter wrote (transformers keeps it as a plain
# attribute): a folder save_pretrained wrote has the same file names, and is the user's, not ours to replace.
EXPORT_MARK = "exported_by_llmtrain"
PARTIAL = ".partial"  # the suffix of a hidden folder an export is staged in


@torch.no_grad()
def export_hf(model: torch.nn.Module, tokenizer: dict[str, Any], context: int, out_dir: Path) -> None:
    """Write `model` (an llmtrain GPT) and its tokenizer (`to_dict()`) as a Hugging Face folder at
    `out_dir`. UnsupportedModel / UserError before any write."""
    cfg = model.cfg
    layouts.layout_of_model(cfg)  # refuses a model with no HF equivalent, naming what differs
    tok, files = tokenizer_files(tokenizer, context)
    vocab = tokenizer_vocab(tok)
    if vocab > model.vocab_size:
        raise UserError(f"the tokenizer has {vocab} tokens but the model's embedding only {model.vocab_size} rows; "
                        "the run's tokenizer.json does not belong to its weights.")
    config = {**layouts.hf_config(cfg, model.vocab_size, tok.bos_id, tok.eos_id), EXPORT_MARK: True}
    files[CONFIG] = json.dumps(config, indent=2)
    files[GENERATION_CONFIG] = json.dumps(generation_config(tok, vocab, model.vocab_size), indent=2)
    state = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
    tensors = layouts.hf_state_dict(cfg, state)
    out_dir = check_target(out_dir)

    def fill(folder: Path) -> None:
        from safetensors.torch import save_file

        for name, text in files.items():
            (folder / name).write_text(text)
        save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})

    write_export(out_dir, fill)


def tokenizer_vocab(tok: HFTokenizer) -> int:
    """Token ids the tokenizer can produce (its vocabulary with the added tokens)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json.dumps(tok.tokenizer)).get_vocab_size(with_added_tokens=True)


def generation_config(tok: HFTokenizer, vocab: int, model_vocab: int) -> dict[str, Any]:
    """bos/eos ids, pad = eos (these models have no pad token), and the padding ids of a model whose
    embedding is larger than the tokenizer suppressed: llmtrain's sample never picks them either."""
    config: dict[str, Any] = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.eos_id}
    if model_vocab > vocab:
        config["suppress_tokens"] = list(range(vocab, model_vocab))
    return config


# ---- the target folder, shared by both export formats ---------------------------------------------

def check_target(out_dir: Path) -> Path:
    """`out_dir` resolved, once it is known to be a place either export format may write: a new
    folder under a writable one, an empty folder, or a previous export (only export files, with an
    export's mark). Anything else is the user's and is refused (UserError) before any work is done."""
    out_dir = Path(out_dir).expanduser().resolve()  # `--out .` has no name to stage a sibling folder by
    if out_dir.parent == out_dir:
        raise UserError(f"--out {out_dir} is the root of the file system; give a folder to export into.")
    blocked = next((p for p in (out_dir, *out_dir.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        kind = "a file" if blocked.is_file() else "not a folder (a FIFO, a device or a socket)"
        where = f"--out {out_dir} is" if blocked == out_dir else f"--out {out_dir} is inside {blocked}, which is"
        raise UserError(f"{where} {kind}; give a folder to export into (new, empty, or a previous export).")
    if out_dir.is_dir():
        _check_previous_export(out_dir)
    # The staged folder is made beside out_dir, and out_dir's missing parents are created: both need
    # the nearest existing folder to be writable (os.access also says no on a read-only file system).
    existing = next(p for p in out_dir.parents if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--out {out_dir} cannot be written: {existing} is not writable (a read-only file system, or "
                        "a folder without write permission); give --out a folder you can write to.")
    return out_dir


def _check_previous_export(out_dir: Path) -> None:
    """An existing `out_dir` must be empty or a previous export, else UserError."""
    # Exports never write links, folders or special files: any of them makes the folder the user's.
    foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in EXPORT_FILES or p.is_symlink()
                     or not p.is_file())
    if foreign:
        raise UserError(
            f"--out {out_dir} holds files an export does not write ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}), so it is not a previous export and is left as it is; give "
            "a new or empty folder, or remove them first."
        )
    if any(out_dir.iterdir()) and not _is_previous_export(out_dir):
        raise UserError(
            f"--out {out_dir} holds a model this exporter did not write (neither an llmtrain export's "
            f"model_config.json nor a config.json with the '{EXPORT_MARK}' mark: a Hugging Face folder, perhaps the "
            "one the run started from), so it is left as it is; give a new or empty folder."
        )


def _is_previous_export(folder: Path) -> bool:
    """An llmtrain-format export (model_config.json), an HF export with the mark in config.json, or a
    peft export with the mark in its safetensors' metadata."""
    if (folder / "model_config.json").is_file() and not (folder / CONFIG).is_file():
        return True
    if (folder / ADAPTER_WEIGHTS).is_file() and not (folder / CONFIG).is_file():
        return _marked_adapters(folder / ADAPTER_WEIGHTS)
    try:
        config = read_json(folder / CONFIG, "the config of the model in --out")
    except UnreadableFile:  # missing, huge, not JSON: not a config this exporter wrote
        return False
    return isinstance(config, dict) and config.get(EXPORT_MARK) is True


def _marked_adapters(weights: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as handle:
            return (handle.metadata() or {}).get(EXPORT_MARK) == "true"
    except Exception:  # noqa: BLE001 - a damaged or foreign file: not ours to replace
        return False


def write_export(out_dir: Path, fill: Callable[[Path], None]) -> None:
    """Have `fill` write an export into a hidden folder beside `out_dir` (which check_target
    resolved), then swap it into place: a previous export there is replaced whole. A failure part way
    (an error, a full disk, Ctrl-C) removes the hidden folder and any parent folder made for it and
    leaves `out_dir` as it was; an OSError becomes one UserError paragraph."""
    staging = out_dir.with_name(f".{out_dir.name}.{os.getpid()}{PARTIAL}")
    made = [p for p in out_dir.parents if not p.exists()]  # deepest first: removed in this order on failure
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(out_dir)
        staging.mkdir()
        fill(staging)
        swap_folder(staging, out_dir)  # a previous export is put back if the swap fails
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()
        if isinstance(err, OSError):  # a full disk, a read-only file system: the user's to fix, not a crash
            raise _write_failed(out_dir, err) from None
        raise


def _remove_leftovers(out_dir: Path) -> None:
    """Hidden folders of exports into `out_dir` that were killed (never a live one's): this process
    id's previous export, and staged folders of processes that no longer run."""
    shutil.rmtree(aside(out_dir), ignore_errors=True)
    prefix = f".{out_dir.name}."
    for leftover in out_dir.parent.glob(f"{glob.escape(prefix)}*{PARTIAL}"):
        pid = leftover.name[len(prefix):-len(PARTIAL)]
        if pid.isdigit() and (int(pid) == os.getpid() or not _running(int(pid))):
            shutil.rmtree(leftover, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # it exists, and belongs to another user
        return True
    return True


def _write_failed(out_dir: Path, err: OSError) -> UserError:
    fix = ("Free space or choose another --out" if err.errno in (errno.ENOSPC, errno.EDQUOT)
           else "Give --out a folder you can write to")
    return UserError(f"writing the export into {out_dir} failed ({type(err).__name__}: {err}); nothing was changed "
                     f"there. {fix}, then run the export again.")
