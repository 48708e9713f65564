"""Every file a run dir holds and every record kind its logs carry, named once.

A run dir (`out_dir`, by default Hydra's `outputs/<date>/<time>`):

    config.yaml        the resolved config of the run (rewritten on every accepted start)
    tokenizer.json     the tokenizer the data was encoded with; a resume must match it
    metrics.jsonl      one JSON record per line, appended (a resumed run continues the file)
    events.jsonl       the health monitor's alarms and actions (also in metrics.jsonl)
    model.pt           the final weights (the unwrapped model's state dict), for sample/export; a
                       LoRA run on a model.init_from folder keeps its adapters alone there
    lora_base.json     such a run's base: the folder's path and the sha256 of its weights
    checkpoints/       step_NNNNNNNN/ folders and `latest` (see checkpoint/layout.py)
    report.md, report.html, report/   the post-run review (`llmtrain report`)
    eval.json          `llmtrain eval`'s results per task (and harness-TASK.json, the harness's own)
    train.log, .hydra/ the CLI's log and Hydra's record of the command (written on acceptance
                       by core/rundir.py)

Writers log dicts whose "kind" is one of `Kind` (through metrics/writer.py's JsonlSink);
runs/records.py is the one reader of both logs. `layout_problems` checks that an existing run dir's names are of their
kind. The data cache (data/prepare.py) keeps its tokenizer under the same name, TOKENIZER; an export
folder's own names are in runs/artifacts.py, a checkpoint folder's in checkpoint/layout.py. This module
imports only the standard library, so any layer may name a file through it.
"""

from __future__ import annotations

import math
import os
from typing import Any

CONFIG = "config.yaml"
TOKENIZER = "tokenizer.json"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
FINAL_WEIGHTS = "model.pt"
LORA_BASE = "lora_base.json"  # a LoRA run's base folder and its weights' sha256 (hf/lora_base.py)
CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"  # inside a checkpoint folder
REPORT_MD = "report.md"
REPORT_HTML = "report.html"
EVAL_RESULTS = "eval.json"  # `llmtrain eval`: the latest metrics of every task evaluated
REPORT_PLOTS = "report"  # the report's PNG files
JOB_LOG = "train.log"
HYDRA_SUBDIR = ".hydra"
TENSORBOARD = "tensorboard"

# What each name must be when it exists: a run dir whose `checkpoints` is a file would look like a
# run with no checkpoints (and restart from step 0) until its first save failed.
FILES = (CONFIG, TOKENIZER, METRICS, EVENTS, FINAL_WEIGHTS, LORA_BASE, REPORT_MD, REPORT_HTML, EVAL_RESULTS, JOB_LOG)
FOLDERS = (CHECKPOINTS, REPORT_PLOTS, HYDRA_SUBDIR, TENSORBOARD)


def layout_problems(run_dir: str | os.PathLike[str]) -> list[str]:
    """The names of an existing run dir that are not what llmtrain keeps there: a folder where a file
    belongs or the reverse, or something that is neither (a FIFO, a broken link); [] when none."""
    problems = []
    for names, want, ok in ((FILES, "a file", os.path.isfile), (FOLDERS, "a folder", os.path.isdir)):
        for name in names:
            path = os.path.join(run_dir, name)
            if os.path.lexists(path) and not ok(path):
                kind = ("a folder" if os.path.isdir(path) else "a file" if os.path.isfile(path)
                        else "a broken link" if os.path.islink(path) else "neither a file nor a folder")
                problems.append(f"{name} is {kind}, but llmtrain keeps {want} of that name there")
    return problems


class Kind:
    """The "kind" of a metrics.jsonl / events.jsonl record (plain strings: the file format)."""

    START = "start"  # the run (or a resumed part of it) begins: steps, seed, device, check verdicts
    SEQ_LEN = "seq_len"  # a sequence-length stage begins
    TRAIN = "train"  # every log_interval: loss, lr, grad norm, tokens/s
    EVAL = "eval"  # every eval_interval: validation loss and perplexity
    EVAL_TASK = "eval_task"  # every eval_interval, one per eval.tasks entry: its metrics
    TIMING = "timing"  # every timing_interval: where one step's time went
    HEALTH = "health"  # every monitor.interval: the monitor's sample
    ALARM = "alarm"  # the monitor raised an alarm
    ACTION = "action"  # what was done about an alarm
    REPAIR = "repair"  # monitor.repair: a confirmed cause fixed mid-run, or the command that fixes it on a rerun
    NONFINITE = "nonfinite"  # a non-finite loss/gradient; the update was not applied
    ROLLBACK = "rollback"  # weights and optimizer went back to a checkpoint
    CHECKPOINT = "checkpoint"  # a checkpoint was saved
    CHECKPOINT_ERROR = "checkpoint_error"  # a save failed (the previous checkpoints are intact)
    END = "end"  # the run's end (also on a stop or failure): peak memory
    SLOWDOWN = "slowdown"  # tokens/s collapsed mid-run (the machine became busy): the figures, warned once
    THREADS = "threads"  # threads=auto changed the thread count mid-run (a trial, kept or reverted): why, the figures
    COMPILE = "compile"  # compile=auto measured eager against compiled mid-run: the figures, which it kept


def json_safe(value: Any) -> Any:
    """`value` as strict JSON can hold it: a NaN or infinite float (also inside lists and dicts)
    becomes the string "nan", "inf" or "-inf", which the readers of records turn back into floats."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
