"""multiple_choice:PATH: JSON lines in HellaSwag's format, scored as the lm-evaluation-harness
scores an output_type multiple_choice task.

Each line holds a context (`ctx`, or `context`), candidate endings (`endings`, or `choices`) and
the index of the right one (`label`: an int, or a digit string as Hugging Face's hellaswag has it).
Every ending is the continuation " " + ending of the context (the harness's default target
delimiter), encoded as the harness encodes a pair (`encode_pair`). The metrics are the harness's
(lm_eval/api/task.py process_results, 0.4.13): acc = argmax of the summed log-likelihood,
acc_norm = argmax of log-likelihood / the ending's length in characters (first maximum on a tie,
np.argmax), their standard errors as lm_eval/api/metrics.py mean_stderr computes them; plus
acc_token, the argmax of the mean log-likelihood per token (nanoGPT-style HellaSwag scripts).
"""

from __future__ import annotations

import codecs
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmtrain.config.eval_tasks import TASK_BYTES, TaskSpec, encodable, target_problem
from llmtrain.core.errors import UserError
from llmtrain.core.readers import UnreadableFile, parse_json, read_lines
from llmtrain.data.corpus import json_kind

if TYPE_CHECKING:
    from llmtrain.config.schema import EvalConfig
    from llmtrain.data.tokenizers import Tokenizer
    from llmtrain.evaluation.scoring import Request, Scorer

CONTEXT_FIELDS = ("ctx", "context")
ENDING_FIELDS = ("endings", "choices")
LABEL_FIELDS = ("label",)
TARGET_DELIMITER = " "  # lm-eval's default between a context and each choice
# A HellaSwag line is ~1 KB: a 1 MB one is no example but a binary file or a data set on one line,
# refused before the rest of it is read (json.loads of a 48 MB line peaked at 1.75 GB).
LINE_BYTES = 1 << 20
# Real tasks have 2 to a few dozen endings; each one is another encoding of the context and another
# request, so a line of a million one-letter endings would be a million of each.
MAX_ENDINGS = 1_000


@dataclass(frozen=True)
class Example:
    where: str  # file:line
    context: str
    endings: list[str]
    label: int


def read_multiple_choice(spec: TaskSpec, cfg: EvalConfig) -> MultipleChoiceSource:
    """The file's first eval.limit examples, each line checked; UserError naming file:line for a
    line that is too long, not UTF-8, not a JSON object, lacks a field, or has bad endings or a bad
    label; UserError for a path that is not a regular file, more than TASK_BYTES, or no example."""
    problem = target_problem(spec)
    if problem is not None:
        raise UserError(f"'{spec.name}': {spec.target} {problem}; give one JSON-lines file with a context, endings "
                        "and a label per line (HellaSwag's format).")
    examples, read = [], 0
    for number, raw in read_lines(Path(spec.target), "a multiple-choice file", LINE_BYTES):
        if cfg.limit is not None and len(examples) >= cfg.limit:
            break
        read += len(raw)
        if read > TASK_BYTES:
            raise UserError(f"'{spec.name}': {spec.target} holds more than {TASK_BYTES >> 30} GB of examples by line "
                            f"{number} (HellaSwag's validation set is 12 MB), more than is held in memory to score; "
                            "set eval.limit=N to score its first N examples, or split it.")
        if number == 1:
            raw = raw.removeprefix(codecs.BOM_UTF8)  # a byte-order mark some editors write: not part of the JSON
        if raw.strip():
            examples.append(parse_example(raw, f"{spec.target}:{number}"))
    if not examples:
        raise UserError(f"'{spec.name}': {spec.target} has no example (no non-blank line); each line is one JSON "
                        'object like {"ctx": "...", "endings": ["...", "..."], "label": 0}.')
    return MultipleChoiceSource(spec, examples)


def parse_example(raw: bytes, where: str) -> Example:
    example = '{"ctx": "A man is", "endings": ["running.", "a dog."], "label": 0}'
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{where} is not UTF-8 text (byte {err.start + 1} of the line is 0x{raw[err.start]:02X}); each "
                        f"line must be one JSON object in UTF-8, such as {example}.") from None
    try:
        record = parse_json(text, where, allow_nan=True)  # NaN in a field llmtrain ignores is no harm
    except UnreadableFile as err:  # not JSON, or nested thousands deep
        raise UserError(f"{err} Each line must be one JSON object such as {example}.") from None
    if not isinstance(record, dict):
        raise UserError(f"{where} is {json_kind(record)}, not a JSON object; each line must be one such as {example}.")
    context = _field(record, CONTEXT_FIELDS, where)
    endings = _field(record, ENDING_FIELDS, where)
    label = _field(record, LABEL_FIELDS, where)
    if not isinstance(context, str):
        raise UserError(f"{where}: the context is {json_kind(context)}, not a string.")
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) for e in endings):
        shown = json.dumps(endings, ensure_ascii=False)
        raise UserError(f"{where}: the endings must be a list of at least 2 strings (the candidates), not "
                        f"{shown[:200]}.")
    if len(endings) > MAX_ENDINGS:
        raise UserError(f"{where} has {len(endings):,} endings; an example has at most {MAX_ENDINGS:,} (real "
                        "tasks have 2 to a few dozen), as each ending is scored with the whole context.")
    if empty := [i for i, e in enumerate(endings) if not e]:
        raise UserError(f"{where}: ending {empty[0]} is empty; every candidate ending needs text (its length "
                        "normalizes acc_norm).")
    for name, value in (("the context", context), *((f"ending {i}", e) for i, e in enumerate(endings))):
        _check_text(value, name, where)
    return Example(where, context, endings, _label(label, len(endings), where))


def _check_text(value: str, name: str, where: str) -> None:
    """A JSON string may escape half of a UTF-16 surrogate pair ("\\ud800"), which is no character:
    no tokenizer can encode it, and some raise a bare TypeError."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise UserError(f"{where}: {name} holds an unpaired surrogate (U+{ord(value[err.start]):04X}, escaped as "
                            f"\\u{ord(value[err.start]):04x} in the JSON), which is not a character; remove it or "
                            "write the whole character.") from None


def _field(record: dict, names: Sequence[str], where: str) -> object:
    for name in names:
        if name in record:
            return record[name]
    accepted = " or ".join(f"'{n}'" for n in names)
    raise UserError(f"{where} has no field {accepted} (it has: {', '.join(sorted(record)) or 'no fields'}).")


def _label(value: object, count: int, where: str) -> int:
    """The label as an index: an int, or a string of digits (Hugging Face's hellaswag: "2")."""
    if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]+\s*", value):
        index = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        index = value
    else:
        raise UserError(f"{where}: the label is {json.dumps(value, ensure_ascii=False)[:100]}, not an integer; it "
                        f"must be the index of the right ending, 0 to {count - 1}.")
    if not 0 <= index < count:
        raise UserError(f"{where}: the label {index} is out of range: this example has {count} endings, so the label "
                        f"must be 0 to {count - 1}.")
    return index


class MultipleChoiceSource:
    """Checked examples, not yet tokenized."""

    def __init__(self, spec: TaskSpec, examples: list[Example]) -> None:
        self.spec, self.examples = spec, examples

    def encode(self, tokenizer: Tokenizer, window: int, eos_id: int, truncate: bool,
               log: Callable[[str], None]) -> MultipleChoiceTask:
        """Every (context, ending) pair as ids. An ending longer than the window is refused; a
        context that does not fit with its ending is cut from the left when scored (said once) or,
        with truncate false, refused."""
        from llmtrain.evaluation.scoring import encode_pair

        requests: list[Request] = []
        cut = 0
        for example in self.examples:
            longest, context = 0, None
            for k, ending in enumerate(example.endings):
                with encodable(example.where):
                    context_ids, ending_ids = encode_pair(tokenizer, example.context, TARGET_DELIMITER + ending, eos_id)
                _check_ending(example.where, k, ending, len(ending_ids), window)
                longest = max(longest, len(context_ids) + len(ending_ids))
                if context is None:  # encode_pair's context ids depend on the context alone: one array per example
                    context = np.asarray(context_ids[-(window + 1):], dtype=np.uint32)
                requests.append((_scored_part(context, len(ending_ids), window),
                                 np.asarray(ending_ids, dtype=np.uint32)))
            # The model reads all but the last token: more than the window is cut (as the Scorer does).
            if longest - 1 > window:
                if not truncate:
                    raise UserError(
                        f"{example.where}: the context and its longest ending are {longest} tokens; the model reads "
                        f"at most {window + 1} (its window of {window} tokens, then the last token is only predicted) "
                        "and eval.truncate=false refuses longer ones. Shorten that context, or let it be cut from "
                        "the left (eval.truncate=true).")
                cut += 1
        if cut:
            log(f"{self.spec.name}: {cut} of {len(self.examples)} examples' contexts are longer than the model's "
                f"window of {window} tokens and are cut from the left; eval.truncate=false refuses them instead")
        return MultipleChoiceTask(self.spec, self.examples, requests)


def _scored_part(context: np.ndarray, ending_tokens: int, window: int) -> np.ndarray:
    """The end of the context that scoring reads, as a view: the Scorer keeps the last window + 1
    tokens of context + ending, and one more token here lets it still see that the context was cut.
    So every ending's request shares one compact array of at most window + 1 ids per example, however
    long the context is in the file (a 1 MB line's context can be a million ids)."""
    keep = window + 2 - ending_tokens  # at least 2: the ending fits the window
    return context[-keep:] if len(context) > keep else context


def _check_ending(where: str, index: int, ending: str, tokens: int, window: int) -> None:
    shown = json.dumps(ending if len(ending) <= 60 else ending[:57] + "...", ensure_ascii=False)
    if tokens == 0:
        raise UserError(f"{where}: ending {index} ({shown}) gives no token after the context (the tokenizer merged it "
                        "into the context's last token), so it cannot be scored.")
    if tokens > window:
        raise UserError(f"{where}: ending {index} ({shown}) is {tokens} tokens, longer than the model's window of "
                        f"{window} tokens, so it cannot be scored; shorten it.")


class MultipleChoiceTask:
    """Tokenized examples: `run` gives acc, acc_norm, acc_token (each with its _stderr when there are
    2 examples or more, as the harness reports N/A for one) and examples."""

    def __init__(self, spec: TaskSpec, examples: list[Example], requests: list[Request]) -> None:
        self.spec, self.examples, self.requests = spec, examples, requests
        self.size = len(requests)

    def run(self, scorer: Scorer, progress: Callable[[int], None] | None = None) -> dict[str, float | int]:
        from llmtrain.evaluation.scoring import REQUESTS_PER_CALL_PER_BATCH

        chunk = scorer.batch_size * REQUESTS_PER_CALL_PER_BATCH  # prepared windows in memory: at most a chunk's
        scores = [score for start in range(0, len(self.requests), chunk)
                  for score in scorer.loglikelihood(self.requests[start:start + chunk], progress)]
        hits: dict[str, list[float]] = {"acc": [], "acc_norm": [], "acc_token": []}
        at = 0
        for example in self.examples:
            chosen = scores[at:at + len(example.endings)]
            at += len(example.endings)
            for metric, pick in choices(example.endings, [s.logprob for s in chosen],
                                        [s.tokens for s in chosen]).items():
                hits[metric].append(1.0 if pick == example.label else 0.0)
        metrics: dict[str, float | int] = {}
        for metric, values in hits.items():
            metrics[metric] = sum(values) / len(values)  # lm_eval.api.metrics.mean
            if len(values) > 1:
                metrics[f"{metric}_stderr"] = mean_stderr(values)
        metrics["examples"] = len(self.examples)
        return metrics


def choices(endings: list[str], logprobs: list[float], tokens: list[int]) -> dict[str, int]:
    """The ending each metric picks, computed as lm-eval does (float64 numpy, np.argmax: the first
    of equal maxima); acc_norm divides by the ending's length in characters, without the delimiter."""
    lls = np.array(logprobs, dtype=np.float64)
    lengths = np.array([float(len(e)) for e in endings])
    return {"acc": int(np.argmax(lls)), "acc_norm": int(np.argmax(lls / lengths)),
            "acc_token": int(np.argmax(lls / np.array(tokens, dtype=np.float64)))}


def mean_stderr(values: list[float]) -> float:
    """lm_eval.api.metrics.mean_stderr: the sample standard deviation (n - 1) over sqrt(n)."""
    mu = sum(values) / len(values)
    return math.sqrt(sum((x - mu) ** 2 for x in values) / (len(values) - 1)) / math.sqrt(len(values))
