"""`llmtrain eval MODEL_DIR [overrides]`: held-out perplexity and bits per byte, multiple-choice
accuracy and lm-evaluation-harness tasks, on a run dir, an export or a Hugging Face folder.

The arguments and every task file are checked before the model is loaded (llmtrain/evaluation/
plan.py); the evaluation itself is llmtrain/evaluation/ (scoring, tasks, the harness adapter, the
results). torch and rich are imported only once the arguments are good.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.cli.common import check_config_dir, fail, flush_denormals_first, parse_command_line

if TYPE_CHECKING:
    import argparse

    import torch

EXAMPLES = """examples:
  llmtrain eval outputs/2026-12-02/10-00-00 data=text data.path=held_out.txt
  llmtrain eval outputs/2026-12-02/10-00-00 eval.tasks=[multiple_choice:hellaswag_val.jsonl]
  llmtrain eval models/SmolLM-135M eval.tasks=[perplexity:held_out/,harness:lambada_openai] --out results/
  llmtrain eval outputs/2026-12-02/10-00-00        (no task: the run's own eval.tasks, else its validation split)

task entries (eval.tasks=[...]):
  perplexity:PATH        held-out text (file, folder, glob or .jsonl): loss, perplexity, bits per byte
  multiple_choice:PATH   JSON lines {"ctx": ..., "endings": [...], "label": N}: acc, acc_norm
  harness:TASK           an lm-evaluation-harness task whose data is local (pip install 'llmtrain[eval]')
"""


def eval_command(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="llmtrain eval",
        description="Evaluate a trained model: the perplexity and bits per byte of held-out text over all of it, "
        "multiple-choice accuracy (HellaSwag's format), and lm-evaluation-harness tasks. Prints a table and writes "
        "eval.json (MODEL_DIR, or --out); the run's report shows it.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model_dir", type=Path,
                        help="a run directory written by `llmtrain train`, an `llmtrain export` folder, or a local "
                        "Hugging Face model folder (GPT-2 or Llama family)")
    parser.add_argument("overrides", nargs="*",
                        help="eval.* keys (eval.tasks=[...], eval.batch_size, eval.stride, eval.limit, ...), and "
                        "data=... data.path=... for the perplexity of that data")
    parser.add_argument("--out", type=Path, default=None, help="folder for eval.json (default: MODEL_DIR)")
    parser.add_argument("--no-truncate", action="store_true",
                        help="refuse a multiple-choice context longer than the model's window (default: cut it from "
                        "the left, and say so once)")
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N or mps")
    parser.add_argument("--config-dir", "-cd", default=None, help="a folder of your own group options (as for train)")
    opts = parse_command_line(parser, args, intermixed=True)  # options may come after the overrides, or between them
    check_config_dir(opts.config_dir)
    if not opts.model_dir.is_dir():
        fail(f"'{opts.model_dir}' is not a folder; give a run directory that `llmtrain train` wrote (its banner prints "
             "it, e.g. outputs/<date>/<time>), an `llmtrain export` folder, or a local Hugging Face model folder.")
    out = opts.out or opts.model_dir
    blocked = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        fail(f"--out is '{out}', but '{blocked}' is a file; give a folder (it is created if missing).")
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not os.access(existing, os.W_OK):
        fail(f"eval.json cannot be written into '{out}' ('{existing}' is not writable); give --out a folder you can "
             "write to.")

    from llmtrain.evaluation.plan import allowed_override

    refused = [o for o in opts.overrides if not allowed_override(o)]
    if refused:
        fail(f"`llmtrain eval` takes eval.* and data overrides only, not {', '.join(repr(o) for o in refused)}: the "
             f"model comes from '{opts.model_dir}' as it was trained. Valid: eval.tasks=[...], eval.batch_size=N, "
             "eval.stride=N, eval.limit=N, eval.harness_include=DIR, data=text data.path=FILE, harness.tasks=[TASK].")
    flush_denormals_first(opts.overrides)
    _evaluate(opts, out)


def _device(name: str) -> torch.device:
    """--device as a torch device; a name torch does not know, or a device this machine lacks: UserError."""
    from llmtrain.core.errors import ConfigError, UserError
    from llmtrain.distributed.layout import resolve_device

    try:
        return resolve_device(name)
    except RuntimeError:  # torch.device() of a name it does not know
        raise UserError(f"--device is '{name}', which is not a device name; use --device auto, cpu, cuda, cuda:N "
                        "or mps.") from None
    except ConfigError as err:  # a device this machine does not have
        reason = str(err).split("; use ")[0].replace("'device' is", "it is")
        raise UserError(f"--device is '{name}' ({reason}); use --device auto or cpu.") from None


def _evaluate(opts: argparse.Namespace, out: Path) -> None:
    from rich.markup import escape

    from llmtrain.cli.compose import compose_config
    from llmtrain.core.console import default_console
    from llmtrain.core.errors import UserError
    from llmtrain.evaluation.plan import plan, split_harness_shorthand, validation_task_source
    from llmtrain.evaluation.runner import render_results, run_tasks, write_results
    from llmtrain.evaluation.scoring import Scorer
    from llmtrain.model import param_count
    from llmtrain.runs.artifacts import load_run

    console = default_console()

    def log(message: str) -> None:
        console.print(f"[dim]{escape(message)}[/]", highlight=False)

    try:
        device = _device(opts.device)
        overrides, harness_entries = split_harness_shorthand(opts.overrides)
        overrides += ["eval.truncate=false"] if opts.no_truncate else []
        cfg = compose_config(overrides, opts.config_dir)
        keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
        eval_keys = frozenset(k.split(".", 1)[1] for k in keys if k.startswith("eval."))
        chosen = plan(opts.model_dir, cfg, any(k.split(".")[0] == "data" for k in keys), harness_entries, eval_keys)
        for note in chosen.notes:  # every file was read and checked: before the model
            log(note)
        settings = chosen.settings
        run = load_run(opts.model_dir, device=str(device))
        if run.tokenizer.eos_id is None:
            raise UserError(f"'{opts.model_dir}': its tokenizer has no end-of-text token, which evaluation puts before "
                            "every document (as training did); retrain it with a current llmtrain.")
        sources = chosen.sources + ([validation_task_source(chosen.validation_of, settings, log)]
                                    if chosen.validation_of else [])
        window = min(run.context, run.model.cfg.block_size)
        tasks = [s.encode(run.tokenizer, window, run.tokenizer.eos_id, settings.truncate, log) for s in sources]
        log(f"model {opts.model_dir}: {param_count(run.model):,} parameters, window {window} tokens, on {device}")
        results = run_tasks(tasks, Scorer(run.model, window, settings.batch_size), console)
        harness = {t.spec.name: t.raw_results for t in tasks if getattr(t, "raw_results", None) is not None}
        about = {"model": str(opts.model_dir.resolve()), "context": window, "parameters": param_count(run.model),
                 "tokenizer": run.tokenizer.to_dict().get("kind")}
        render_results(results, console)  # first: a results folder that cannot be written loses nothing shown
        path = write_results(out, results, about, harness)
    except UserError as err:
        fail(str(err))
    console.print(f"results in {escape(str(path))}", highlight=False)
    sys.stdout.flush()
