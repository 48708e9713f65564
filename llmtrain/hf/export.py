"""`llmtrain export RUN_DIR --format hf`: a folder transformers loads with no llmtrain code.

`AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)` read it:
config.json (GPT2LMHeadModel or LlamaForCausalLM, layouts.hf_config), model.safetensors under HF's
tensor names (the tied head left out, as transformers saves it), generation_config.json and the
tokenizer files (tokenizer_files.py). Everything is checked and built in memory first (a model with
no HF equivalent is refused before a byte is written), written into a hidden folder beside the
target and renamed into place at the end: an interrupted export never leaves a half folder, and a
folder holding anything an export does not write is refused, not overwritten.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from llmtrain.errors import UserError
from llmtrain.hf import layouts
from llmtrain.hf.folder import CONFIG, GENERATION_CONFIG, WEIGHTS
from llmtrain.hf.tokenizer_files import SPECIAL_TOKENS_MAP, TOKENIZER, TOKENIZER_CONFIG, HFTokenizer, tokenizer_files

# Every file either export format writes: a folder holding only these, with an export's mark, is a
# previous export, safe to replace.
EXPORT_FILES = frozenset({CONFIG, WEIGHTS, GENERATION_CONFIG, TOKENIZER, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP,
                          "model_config.json"})
# The key of config.json that marks a folder this exporter wrote (transformers keeps it as a plain
# attribute): a folder save_pretrained wrote has the same file names, and is the user's, not ours to replace.
EXPORT_MARK = "exported_by_llmtrain"


@torch.no_grad()
def export_hf(model: torch.nn.Module, tokenizer: dict[str, Any], context: int, out_dir: Path) -> None:
    """Write `model` (an llmtrain GPT) and its tokenizer (`to_dict()`) as a Hugging Face folder at
    `out_dir`. UnsupportedModel / UserError before any write."""
    out_dir = Path(out_dir).expanduser().resolve()  # `--out .` has no name to stage a sibling folder by
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
    check_target(out_dir)
    _write_atomically(out_dir, files, tensors)


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


def check_target(out_dir: Path) -> None:
    """`out_dir` may be new, empty, or a previous export (only export files); anything else is the
    user's and is refused before any work is written."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} is a file; give a folder to export into (new, empty, or a previous export).")
    if out_dir.is_dir():
        foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in EXPORT_FILES or not p.is_file())
        if foreign:
            raise UserError(
                f"--out {out_dir} holds files an export does not write ({', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}), so it is not a previous export and is left as it is; give "
                "a new or empty folder, or remove them first."
            )
        if any(out_dir.iterdir()) and not _is_previous_export(out_dir):
            raise UserError(
                f"--out {out_dir} holds a model this exporter did not write (its config.json lacks the "
                f"'{EXPORT_MARK}' mark: a Hugging Face folder, perhaps the one the run started from), so it is left "
                "as it is; give a new or empty folder."
            )


def _is_previous_export(folder: Path) -> bool:
    """An llmtrain-format export (model_config.json), or an HF export with the mark in config.json."""
    if (folder / "model_config.json").is_file() and not (folder / CONFIG).is_file():
        return True
    try:
        return bool(json.loads((folder / CONFIG).read_text()).get(EXPORT_MARK))
    except (OSError, ValueError, AttributeError):
        return False


def _write_atomically(out_dir: Path, files: dict[str, str], tensors: dict[str, torch.Tensor]) -> None:
    """Write `files` and the safetensors weights into a hidden folder beside `out_dir`, then swap it
    into place (a previous export there is replaced whole); a failure part way removes the hidden
    folder and leaves `out_dir` as it was."""
    from safetensors.torch import save_file

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.partial")
    old = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.old")
    for leftover in (staging, old):  # from an export of this pid that was killed: never a live one
        shutil.rmtree(leftover, ignore_errors=True)
    staging.mkdir()
    moved = False
    try:
        for name, text in files.items():
            (staging / name).write_text(text)
        save_file(tensors, str(staging / WEIGHTS), metadata={"format": "pt"})
        if out_dir.exists():
            out_dir.rename(old)
            moved = True
        staging.rename(out_dir)
    except BaseException as err:
        if moved and not out_dir.exists():
            old.rename(out_dir)  # put the previous export back
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, OSError):  # a full disk, a read-only folder: the user's to fix, not a crash
            raise UserError(f"writing the export into {out_dir} failed ({type(err).__name__}: {err}); nothing was "
                            "changed there. Free space or choose another --out, then run the export again.") from None
        raise
    shutil.rmtree(old, ignore_errors=True)
