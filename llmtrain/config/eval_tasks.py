"""The names of evaluation tasks: `eval.tasks` entries such as `perplexity:held_out.txt`,
`multiple_choice:hellaswag_val.jsonl` or `harness:arc_easy`, parsed into `TaskSpec`s.

Standard library only and no file read (`target_problem` asks the file system what a path is), so
config validation can call `parse_task_specs` before any work starts (and without importing torch);
the files are read by `llmtrain.evaluation.tasks`.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from llmtrain.core.errors import ConfigError, UserError

KINDS = ("perplexity", "multiple_choice", "harness")
# The most text one task may hold: a task is read whole into memory (and tokenized there), so a
# bigger text file is refused before it is read, and documents or examples past this when they are
# reached (eval.limit stops reading sooner). Far above real held-out sets: WikiText-103's test split
# is 1.3 MB, HellaSwag's validation set 12 MB.
TASK_BYTES = 1 << 30
_TARGETS = {"perplexity": "PATH", "multiple_choice": "PATH", "harness": "TASK"}
VALID_FORMS = ("perplexity:PATH (held-out text: a file, a folder, a glob or .jsonl files), multiple_choice:PATH "
               "(HellaSwag-style JSON lines) or harness:TASK (an lm-evaluation-harness task)")
# What people write for a kind, beyond typos difflib finds (normalized: lower case, '-' and ' ' as '_').
_ALIASES = {
    "ppl": "perplexity", "pplx": "perplexity", "perplex": "perplexity", "bpb": "perplexity",
    "bits_per_byte": "perplexity", "loss": "perplexity", "text": "perplexity", "held_out": "perplexity",
    "mc": "multiple_choice", "multiplechoice": "multiple_choice", "choice": "multiple_choice",
    "choices": "multiple_choice",
    "lm_eval": "harness", "lmeval": "harness", "lm_evaluation_harness": "harness", "eval_harness": "harness",
}


@dataclass(frozen=True)
class TaskSpec:
    kind: str  # "perplexity" | "multiple_choice" | "harness"
    target: str  # the path (as written, ~ expanded) or the harness task name
    name: str  # the entry as the user wrote it, e.g. "perplexity:held_out.txt": the key of its results


# The run's own validation split (the val token stream of its prepared data), scored as held-out
# text. `read_tasks` gives it for this entry when it is handed the run's prepared data; a file
# that happens to be called "validation" is named `perplexity:./validation`.
VALIDATION = TaskSpec("perplexity", "validation", "perplexity:validation")


def parse_task_specs(entries: Sequence[str], key: str = "eval.tasks") -> list[TaskSpec]:
    """One TaskSpec per entry, in order. ConfigError (a UserError: one paragraph naming the entry,
    `key` and the valid forms) for an entry without a kind or a target, an unknown kind (with the
    close one suggested) or a repeated entry. Nothing is opened: a path is checked when read."""
    specs: list[TaskSpec] = []
    seen: dict[tuple[str, str], str] = {}
    for raw in entries:
        spec = _parse_entry(raw, key)
        previous = seen.get((spec.kind, spec.target))
        if previous is not None:
            same = "is given twice" if previous == spec.name else f"names the same task as '{previous}'"
            raise ConfigError(f"'{key}': the entry '{spec.name}' {same}; each task is run once, so list it once.")
        seen[(spec.kind, spec.target)] = spec.name
        specs.append(spec)
    return specs


def _parse_entry(raw: object, key: str) -> TaskSpec:
    entry = str(raw).strip()
    kind, colon, target = entry.partition(":")
    kind, target = kind.strip(), target.strip()
    if not entry:
        raise _bad(key, "''", "is empty")
    if not colon:
        known = _known_kind(kind, cutoff=0.8)  # strict: a bare word is more often a forgotten kind than a typo
        if known:
            raise _bad(key, f"'{entry}'", f"names the kind but no {_TARGETS[known]}: write {known}:{_TARGETS[known]}")
        raise _bad(key, f"'{entry}'", f"has no kind: write perplexity:{entry} (held-out text), multiple_choice:{entry} "
                   f"(a multiple-choice file) or harness:{entry} (an lm-evaluation-harness task)")
    if kind not in KINDS:
        known = _known_kind(kind)
        hint = f" (did you mean {known}:{target or _TARGETS[known]}?)" if known else ""
        raise _bad(key, f"'{entry}'", f"has the unknown kind '{kind}'{hint}")
    if not target:
        raise _bad(key, f"'{entry}'", f"has no {_TARGETS[kind]} after the colon")
    if kind != "harness":
        target = os.path.expanduser(target)
    return TaskSpec(kind, target, entry)


def _known_kind(word: str, cutoff: float = 0.6) -> str | None:
    """The kind `word` means: itself, an alias or a near spelling; None if none is close."""
    normal = word.strip().lower().replace("-", "_").replace(" ", "_")
    if normal in KINDS:
        return normal
    if normal in _ALIASES:
        return _ALIASES[normal]
    close = difflib.get_close_matches(normal, [*KINDS, *_ALIASES], n=1, cutoff=cutoff)
    return (_ALIASES.get(close[0], close[0])) if close else None


def _bad(key: str, entry: str, problem: str) -> ConfigError:
    return ConfigError(f"'{key}': the entry {entry} {problem}. Each entry is {VALID_FORMS}, e.g. "
                       f"{key}=[perplexity:held_out.txt,multiple_choice:hellaswag_val.jsonl].")


def target_problem(spec: TaskSpec) -> str | None:
    """Why the path of `spec` is not a readable regular file ("does not exist (resolved to ...)",
    "is a folder, ...", "is a FIFO (named pipe), ..."), or None. It only asks the file system: a FIFO
    is never opened (that would block forever), nor a device (/dev/zero never ends)."""
    from llmtrain.core.readers import regular_file_problem

    problem = regular_file_problem(Path(spec.target))
    if problem is not None and not os.path.lexists(spec.target):
        problem += f" (resolved to {Path(spec.target).resolve()})"
    return problem


@contextmanager
def encodable(where: str) -> Iterator[None]:
    """Inside: tokenizing a text of `where` (file:line). A text the tokenizer cannot encode (a char
    tokenizer meeting a character it never saw raises ValueError naming it) becomes a UserError
    naming the place and the character. Shared by the task modules; here because it needs nothing
    but the standard library."""
    try:
        yield
    except ValueError as err:  # CharTokenizer.encode: "character 'x' is not in this char tokenizer's vocabulary"
        why = (" (its tokenizer was built from the training data's characters)" if "char tokenizer" in str(err) else "")
        raise UserError(f"{where}: {err}, so the model cannot score this text{why}. Remove that text or replace "
                        "what the tokenizer cannot encode.") from None
