"""Evaluation tasks, from their entries to their metrics, in three steps:

1. `read_tasks(specs, cfg)` reads and checks every file (no model, no tokenizer): a bad line, a
   label out of range or a missing file is refused before any expensive work; harness:TASK
   entries are checked by llmtrain.evaluation.harness. It gives one `TaskSource` per entry.
2. `TaskSource.encode(tokenizer, window, eos_id, truncate, log)` tokenizes it for one model: a
   `Task`, with `size` (the requests it will score, for a progress bar).
3. `Task.run(scorer, progress)` scores it and returns its metrics (plain floats and ints).

The built-in kinds live in perplexity.py (perplexity:PATH, the perplexity of `data=...`, the
run's validation split) and multiple_choice.py (HellaSwag-style JSON lines).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from llmtrain.config.eval_tasks import VALIDATION, TaskSpec
from llmtrain.core.errors import UserError
from llmtrain.evaluation.multiple_choice import MultipleChoiceSource, MultipleChoiceTask, read_multiple_choice
from llmtrain.evaluation.perplexity import (
    PerplexityTask,
    TextSource,
    ValidationSource,
    data_source,
    read_perplexity,
    validation_source,
)

if TYPE_CHECKING:
    from llmtrain.config.schema import EvalConfig
    from llmtrain.data.cache import PreparedData
    from llmtrain.data.tokenizers import Tokenizer
    from llmtrain.evaluation.scoring import Scorer

__all__ = [
    "MultipleChoiceSource", "MultipleChoiceTask", "PerplexityTask", "Task", "TaskSource", "TextSource",
    "ValidationSource", "data_source", "read_tasks", "validation_source",
]


class Task(Protocol):
    spec: TaskSpec
    size: int  # requests it will score (for a progress bar)

    def run(self, scorer: Scorer, progress: Callable[[int], None] | None = None) -> dict[str, float | int]:
        """The task's metrics: perplexity -> loss, perplexity, bits_per_byte, tokens, bytes, documents;
        multiple_choice -> acc, acc_norm, acc_token (+ *_stderr), examples; harness -> the harness's."""
        ...


class TaskSource(Protocol):
    spec: TaskSpec

    def encode(self, tokenizer: Tokenizer, window: int, eos_id: int, truncate: bool,
               log: Callable[[str], None]) -> Task:
        """The task tokenized for a model whose context is `window` tokens; `log` hears, once, what
        the reader should know (contexts cut to the window, bytes that were not UTF-8)."""
        ...


def read_tasks(specs: Sequence[TaskSpec], cfg: EvalConfig, data: PreparedData | None = None) -> list[TaskSource]:
    """One source per spec, in order, every file read and checked. `data` is the run's prepared data,
    for the entry perplexity:validation (its validation split); without it that entry is refused."""
    sources: list[TaskSource] = []
    harness = [spec for spec in specs if spec.kind == "harness"]
    if harness:
        # Checked first and together: lm-eval missing is one message, not one per task.
        from llmtrain.evaluation.harness import check_tasks

        check_tasks([spec.target for spec in harness], cfg.harness_include)
    for spec in specs:
        sources.append(_read(spec, cfg, data))
    return sources


def _read(spec: TaskSpec, cfg: EvalConfig, data: PreparedData | None) -> TaskSource:
    if spec == VALIDATION:
        if data is None:
            raise UserError(f"'{spec.name}' is the run's own validation split, which is evaluated only with the run's "
                            "data at hand (`llmtrain eval RUN_DIR` with no task named, or `llmtrain train`); for a "
                            "file called validation write perplexity:./validation.")
        return validation_source(data, cfg)
    if spec.kind == "perplexity":
        return read_perplexity(spec, cfg)
    if spec.kind == "multiple_choice":
        return read_multiple_choice(spec, cfg)
    if spec.kind == "harness":
        from llmtrain.evaluation.harness import HarnessTask

        return HarnessTask(spec, cfg)
    raise ValueError(f"unknown task kind {spec.kind!r}")  # parse_task_specs admits no other
