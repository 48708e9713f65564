"""Evaluation results as text: a task's headline metrics on one line, and how much it scored."""

from __future__ import annotations

import math
from typing import Any

# An evaluation task's headline metrics, in this order, as (key, label, format): the rest (counts,
# standard errors) are in metrics.jsonl. A harness task's own metrics are shown when none of these is there.
TASK_HEADLINE = (("loss", "loss", "{:.4f}"), ("perplexity", "ppl", "{:.2f}"), ("bits_per_byte", "bits/byte", "{:.4f}"),
                 ("acc", "acc", "{:.4f}"), ("acc_norm", "acc_norm", "{:.4f}"))
TASK_COUNTS = ("tokens", "bytes", "documents", "examples")
TASK_OTHER_SHOWN = 4  # a harness task's metrics on one line, at most


def task_metrics_text(metrics: dict[str, Any], sep: str = "  ") -> str:
    """A task's headline metrics on one line: "loss 1.2340  ppl 3.43  bits/byte 1.7800", "acc 0.4000
    acc_norm 0.4500", or (a harness task) its own numeric metrics, standard errors and counts left out."""
    shown = [(label, fmt, metrics[key]) for key, label, fmt in TASK_HEADLINE if is_number(metrics.get(key))]
    if not shown:
        skip = {"kind", "step", "task", "seconds", *TASK_COUNTS}
        shown = [(key, "{:.4g}", value) for key, value in metrics.items()
                 if key not in skip and "stderr" not in key and is_number(value)][:TASK_OTHER_SHOWN]
    return sep.join(f"{label} {fmt.format(value) if math.isfinite(value) else value}" for label, fmt, value in shown)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scored_text(metrics: dict[str, Any], keys: tuple[str, ...] = TASK_COUNTS, at_most: int | None = None) -> str:
    """How much a task scored, from its counts: '1,500 tokens, 1,500 bytes, 1 document'."""
    counts = [f"{metrics[key]:,} {key if metrics[key] != 1 else key.removesuffix('s')}"
              for key in keys if is_number(metrics.get(key)) and isinstance(metrics[key], int)]
    return ", ".join(counts[:at_most])
