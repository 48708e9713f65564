"""harness:TASK: any lm-evaluation-harness task (the `eval` extra: `pip install 'llmtrain[eval]'`),
with llmtrain's model wrapped as an `lm_eval.api.model.LM`.

`ScorerLM` answers the harness's three request types on a `Scorer`: loglikelihood (the pairs encoded
as the harness's own HFLM encodes them, `encode_pair`), loglikelihood_rolling (a document's windows,
`rolling_requests`) and generate_until (llmtrain/generation.py's `generate`, greedy unless the task samples).
`HarnessTask` is a TaskSource and a Task both: the harness tokenizes its documents itself, so
`encode` only remembers the tokenizer and `run` calls `lm_eval.simple_evaluate` on one task (or
group). Nothing is downloaded unless the user allows it (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE).

lm_eval is imported here only, and lazily: without it, `check_tasks` says how to install it.
Tested with lm-eval 0.4.11 and 0.4.13 (their TaskManager, simple_evaluate and results layout).
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtrain.config.eval_tasks import TaskSpec, encodable
from llmtrain.core.errors import UserError

if TYPE_CHECKING:
    from llmtrain.config.schema import EvalConfig
    from llmtrain.data.tokenizers import Tokenizer
    from llmtrain.evaluation.scoring import Request, Scorer

INSTALL = "pip install 'llmtrain[eval]'"
DEFAULT_MAX_GEN_TOKS = 256  # the harness's HFLM default when a task names none
SAMPLING_SEED = 1234  # the harness's own default seed, for tasks that sample
OFFLINE_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
log = logging.getLogger(__name__)

# TaskManager(include_path, include_defaults) -> its index. Indexing the harness's bundled tasks
# parses every YAML file it ships (14,683 names in 0.4.13: 15-18 s on 2 cores; 0.4.11: 6 s), so it is done
# once per process and shared by check_tasks, every run and every in-training evaluation.
_MANAGERS: dict[tuple[str | None, bool], Any] = {}
INDEX_SECONDS: dict[tuple[str | None, bool], float] = {}  # how long each index took to build


def require_lm_eval() -> Any:
    """The lm_eval module; UserError with the install command when it is missing or broken."""
    try:
        import lm_eval
    except ImportError as err:
        broken = "" if err.name in (None, "lm_eval") else f" (importing it failed: {err})"
        raise UserError(f"harness:TASK entries need the lm-evaluation-harness, which is not installed{broken}. "
                        f"Install it with `{INSTALL}` (or `pip install lm_eval`), or remove the harness:TASK "
                        "entries from eval.tasks.") from None
    return lm_eval


def check_tasks(names: Sequence[str], include_path: str | None) -> None:
    """UserError (before any model work) if lm-eval is missing, eval.harness_include is not a folder,
    or a name is no task, group or tag the harness knows (with close names suggested)."""
    require_lm_eval()
    folder = include_folder(include_path)
    manager = task_manager(folder, names)
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            raise UserError(_unknown_task(name, manager, folder))


def include_folder(include_path: str | None) -> str | None:
    """eval.harness_include as an absolute folder (None when unset); UserError if it is not one."""
    if include_path is None or not str(include_path).strip():
        return None
    path = Path(include_path).expanduser()
    if not path.is_dir():
        what = "is a file" if path.is_file() else f"does not exist (resolved to {path.resolve()})"
        raise UserError(f"eval.harness_include={include_path} {what}; give a folder of lm-evaluation-harness task "
                        "YAML files (each with a `task: NAME` key), or leave it null for the harness's own tasks.")
    return str(path.resolve())


def task_manager(folder: str | None, names: Sequence[str]) -> Any:
    """The harness's TaskManager for `names`, built once per process. When every name is a task of
    the user's own folder, the folder alone is indexed (milliseconds); otherwise the harness's
    bundled tasks are indexed as well, the folder's overriding those of the same name."""
    if folder is not None:
        own = _manager(folder, include_defaults=False)
        if names and all(name in own.all_subtasks for name in names):
            return own
    return _manager(folder, include_defaults=True)


def _manager(folder: str | None, include_defaults: bool) -> Any:
    key = (folder, include_defaults)
    if key not in _MANAGERS:
        from lm_eval.tasks import TaskManager

        started = time.perf_counter()
        _MANAGERS[key] = TaskManager(include_path=folder, include_defaults=include_defaults)
        INDEX_SECONDS[key] = time.perf_counter() - started
        log.debug("lm-eval task index (%s, bundled tasks %s): %.1f s", folder, include_defaults, INDEX_SECONDS[key])
    return _MANAGERS[key]


def _unknown_task(name: str, manager: Any, folder: str | None) -> str:
    from lm_eval import __version__

    close = difflib.get_close_matches(name, manager.all_tasks, n=3, cutoff=0.6)
    hint = f" (close names: {', '.join(close)})" if close else ""
    if folder is None:
        own = ("For a task of your own, put its YAML file in a folder and set eval.harness_include=FOLDER "
               "(with the data on disk: dataset_path: json, dataset_kwargs: {data_files: ...}).")
    else:
        mine = _manager(folder, include_defaults=False).all_tasks
        listed = ", ".join(mine[:8]) + (", ..." if len(mine) > 8 else "") if mine else "none"
        own = (f"The folder eval.harness_include={folder} adds {len(mine)} name(s) ({listed}); a YAML file there that "
               "does not parse, or has no `task:` or `group:` key, is skipped.")
    return (f"harness:{name}: the lm-evaluation-harness {__version__} has no task, group or tag named '{name}'{hint}. "
            f"{own} `lm-eval ls tasks` lists the harness's own tasks.")


@dataclass(frozen=True)
class _Encoding:
    tokenizer: Tokenizer
    window: int
    eos_id: int
    truncate: bool
    log: Callable[[str], None]


class HarnessTask:
    """One harness task (or group, or tag) run through `lm_eval.simple_evaluate` on llmtrain's model.
    `size` is 0 (unknown) until it has run once: then it is the requests that run scored, so a later
    evaluation (during training) has a progress total. `raw_results` is the harness's own results
    dict of the latest run, JSON-ready as its EvaluationTracker writes it."""

    def __init__(self, spec: TaskSpec, cfg: EvalConfig) -> None:
        self.spec, self.cfg = spec, cfg
        self.size = 0
        self.raw_results: dict[str, Any] | None = None
        self._encoding: _Encoding | None = None

    def encode(self, tokenizer: Tokenizer, window: int, eos_id: int, truncate: bool,
               log: Callable[[str], None]) -> HarnessTask:
        """The harness tokenizes its documents itself; this remembers how."""
        self._encoding = _Encoding(tokenizer, window, eos_id, truncate, log)
        return self

    def run(self, scorer: Scorer, progress: Callable[[int], None] | None = None) -> dict[str, float | int]:
        """The task's metrics, flat: acc, acc_stderr, acc_norm, ... (another filter than the default
        as metric[filter]); for a group its aggregate, for a tag each task's as TASK/metric."""
        if self._encoding is None:
            raise RuntimeError("HarnessTask.run before encode")
        e = self._encoding
        lm = scorer_lm_class()(scorer, e.tokenizer, e.eos_id, e.window, stride=self.cfg.stride,
                               truncate=e.truncate, progress=progress, name=self.spec.name)
        manager = task_manager(include_folder(self.cfg.harness_include), [self.spec.target])
        results = run_harness(lm, self.spec, manager, self.cfg.limit)
        if lm.cut:
            e.log(f"{self.spec.name}: {lm.cut} of {lm.scored} requests' contexts are longer than the model's window "
                  f"of {e.window} tokens and are cut from the left; eval.truncate=false refuses them instead")
        self.size = lm.scored
        self.raw_results = jsonable(results)
        return flat_metrics(self.raw_results, self.spec.target)


def run_harness(lm: Any, spec: TaskSpec, manager: Any, limit: int | None) -> dict[str, Any]:
    """`lm_eval.simple_evaluate` of one task on `lm`, offline and quiet, the process's random
    states left as they were. A failure before the model was asked anything (the task's data not
    on disk, a template that does not render) is one UserError naming the task."""
    import lm_eval

    from llmtrain.evaluation.scoring import random_states_kept

    offline = not any(os.environ.get(v) is not None for v in OFFLINE_VARIABLES)
    try:
        with _harness_quiet(offline), random_states_kept():
            results = lm_eval.simple_evaluate(model=lm, tasks=[spec.target], task_manager=manager, limit=limit,
                                              log_samples=False)
    except UserError:
        raise
    except Exception as err:
        if lm.scored:  # the model had answered: not a problem of the task's data
            raise
        raise UserError(_load_failure(spec, err, offline)) from None
    if results is None:  # only a rank other than 0 gets None; ScorerLM is always rank 0
        raise RuntimeError("lm_eval.simple_evaluate returned no results")
    return results


def _load_failure(spec: TaskSpec, err: Exception, offline: bool) -> str:
    text = " ".join(str(err).split())[:400] or "no message"
    where = ("llmtrain runs harness tasks offline, so a task's data must be available locally: in the Hugging Face "
             "datasets cache (from an earlier run with a network; HF_DATASETS_OFFLINE=0 lets the harness download it) "
             if offline else "its data must be available: in the Hugging Face datasets cache ")
    return (f"'{spec.name}': the lm-evaluation-harness could not prepare the task ({type(err).__name__}: {text}). "
            f"{where}or as local files (a task YAML of your own with dataset_path: json and dataset_kwargs: "
            "{data_files: {test: FILE}}, in the folder eval.harness_include).")


@contextmanager
def _harness_quiet(offline: bool) -> Iterator[None]:
    """For the call only: no download when the user set neither offline variable; the harness's INFO
    logging and its progress bars off (llmtrain shows its own), unless LMEVAL_LOG_LEVEL asks; and
    its environment report made cheaply (torch's collect_env and importing transformers took 7 s,
    at every evaluation during training)."""
    import lm_eval.api.task
    import lm_eval.evaluator

    with ExitStack() as stack:
        if offline:
            stack.enter_context(_offline())
        if not os.environ.get("LMEVAL_LOG_LEVEL"):
            stack.enter_context(_logger_level("lm_eval", logging.WARNING))
            stack.enter_context(_datasets_bars_off())
            stack.enter_context(
                _patched(lm_eval.api.task, "tqdm", functools.partial(lm_eval.api.task.tqdm, disable=True))
            )
        stack.enter_context(_patched(lm_eval.evaluator, "add_env_info", _env_info))
        stack.enter_context(_patched(lm_eval.evaluator, "get_git_commit_hash", lambda: None))
        yield


@contextmanager
def _offline() -> Iterator[None]:
    """HF_DATASETS_OFFLINE / HF_HUB_OFFLINE set for the call. `datasets` and `huggingface_hub` read
    them once, when imported (which lm_eval did already), so their flags are set too."""
    import datasets.config
    import huggingface_hub.constants

    with ExitStack() as stack:
        for variable in OFFLINE_VARIABLES:
            stack.enter_context(_environment(variable, "1"))
        stack.enter_context(_patched(datasets.config, "HF_HUB_OFFLINE", True))
        stack.enter_context(_patched(datasets.config, "HF_DATASETS_OFFLINE", True))
        stack.enter_context(_patched(huggingface_hub.constants, "HF_HUB_OFFLINE", True))
        yield


@contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    if not hasattr(owner, name):  # another lm-eval version: leave it as that version has it
        yield
        return
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextmanager
def _environment(variable: str, value: str) -> Iterator[None]:
    saved = os.environ.get(variable)
    os.environ[variable] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = saved


@contextmanager
def _logger_level(name: str, level: int) -> Iterator[None]:
    logger = logging.getLogger(name)
    saved = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(saved)


@contextmanager
def _datasets_bars_off() -> Iterator[None]:
    import datasets

    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def _env_info(storage: dict[str, Any]) -> None:
    """The keys lm_eval.loggers.utils.add_env_info writes, without its slow parts."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "N/A"

    storage.update({
        "pretty_env_info": f"PyTorch {torch.__version__}; Python {platform.python_version()}; {platform.platform()}; "
                           f"llmtrain {installed('llmtrain')}",
        "transformers_version": installed("transformers"),
        "lm_eval_version": installed("lm_eval"),
        "upper_git_hash": None,
    })


def jsonable(results: dict[str, Any]) -> dict[str, Any]:
    """The harness's results as its EvaluationTracker writes them (json.dumps with its
    handle_non_serializable: numpy numbers as numbers, sets as lists, anything else as str),
    without per-document samples."""
    import json

    from lm_eval.utils import handle_non_serializable

    kept = {k: v for k, v in results.items() if k != "samples"}
    return json.loads(json.dumps(kept, default=handle_non_serializable, ensure_ascii=False))


def flat_metrics(results: dict[str, Any], name: str) -> dict[str, float | int]:
    """`name`'s metrics from the harness's results: its group row, else its task row, else (a tag)
    every task's as TASK/metric; plus `examples`, the documents scored."""
    section = results.get("groups", {}).get(name) or results.get("results", {}).get(name)
    if section is not None:
        metrics = _metrics_of(section)
    else:
        metrics = {f"{task}/{key}": value for task, row in results.get("results", {}).items()
                   for key, value in _metrics_of(row).items()}
    counts = [n.get("effective") for n in results.get("n-samples", {}).values() if isinstance(n, dict)]
    if counts and all(isinstance(c, int) for c in counts):
        metrics["examples"] = sum(counts)
    return metrics


def _metrics_of(row: dict[str, Any]) -> dict[str, float | int]:
    """{"acc,none": 0.5, "acc_stderr,none": 0.1, "exact_match,strict-match": 0.2, "alias": ...} ->
    {"acc": 0.5, "acc_stderr": 0.1, "exact_match[strict-match]": 0.2}: numbers only ("N/A"
    stderrs, aliases and the harness's sample_len are left out)."""
    out: dict[str, float | int] = {}
    for key, value in row.items():
        if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        metric, _, filter_name = key.partition(",")
        out[metric if filter_name == "none" else f"{metric}[{filter_name}]"] = value
    return out


class _Adapter:
    """The body of ScorerLM (see there); a plain class so this module imports without lm_eval."""

    def __init__(self, scorer: Scorer, tokenizer: Tokenizer, eos_id: int, window: int, *,
                 stride: int | None = None, truncate: bool = True, progress: Callable[[int], None] | None = None,
                 name: str = "harness", seed: int = SAMPLING_SEED) -> None:
        super().__init__()  # lm_eval's LM: rank 0 of 1, no cache hook
        self.scorer, self.tokenizer, self.eos_id, self.window = scorer, tokenizer, eos_id, window
        self.stride, self.truncate, self.progress, self.name, self.seed = stride, truncate, progress, name, seed
        self.scored = 0  # requests answered so far
        self.cut = 0  # of them, contexts cut from the left to fit the window

    # What simple_evaluate reads of an LM besides the three request types (0.4.13): rank and
    # world_size (LM's defaults: 0 and 1), get_model_info for results["config"], and
    # tokenizer_name / chat_template only for a chat template, which llmtrain never asks for.
    @property
    def max_length(self) -> int:
        return self.window

    @property
    def eot_token_id(self) -> int:
        return self.eos_id

    @property
    def tokenizer_name(self) -> str:
        return f"llmtrain-{type(self.tokenizer).__name__}"

    def get_model_info(self) -> dict[str, Any]:
        model = self.scorer.model
        first = next(model.parameters())
        return {"model_num_parameters": sum(p.numel() for p in model.parameters()), "model_dtype": str(first.dtype),
                "window": self.window, "batch_size": self.scorer.batch_size}

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each continuation after its context, all in one Scorer call."""
        from llmtrain.evaluation.scoring import encode_pair

        pairs: list[Request | None] = []
        for request in requests:
            context, continuation = request.args[0], request.args[1]
            with encodable(self._where(request)):
                ids = encode_pair(self.tokenizer, context, continuation, self.eos_id)
            # An empty continuation (the tokenizer merged it into the context) has probability 1.
            pairs.append(self._fitted(ids, request) if ids[1] else None)
        scores = iter(self._score([p for p in pairs if p is not None]))
        out: list[tuple[float, bool]] = []
        for pair in pairs:
            score = next(scores) if pair is not None else None
            out.append((score.logprob, score.greedy) if score is not None else (0.0, True))
        return out

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        """Each document's summed log-probability from end-of-text on: its windows (every token
        scored once, eval.stride) flattened into one Scorer call, then summed per document."""
        from llmtrain.evaluation.scoring import rolling_requests

        windows: list[Request] = []
        owner: list[int] = []
        for i, request in enumerate(requests):
            with encodable(self._where(request)):
                tokens = self.tokenizer.encode(request.args[0])
            for window in rolling_requests(tokens, self.eos_id, self.window, self.stride):
                windows.append(window)
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, score in zip(owner, self.scorer.loglikelihood(windows, self.progress, greedy=False)):
            totals[i] += score.logprob
        self.scored += len(windows)
        return totals

    def generate_until(self, requests: list[Any]) -> list[str]:
        """Each context's continuation (generation.generate, sliding over the window), up to the
        first `until` string (cut off, as the harness expects), end-of-text or max_gen_toks."""
        model = self.scorer.model
        was_training = model.training
        model.eval()
        generator = None
        try:
            out = []
            for request in requests:
                context, kwargs = request.args[0], dict(request.args[1] or {})
                temperature, top_k = self._sampling(kwargs)
                if temperature > 0 and generator is None:
                    import torch

                    generator = torch.Generator().manual_seed(self.seed)
                with encodable(self._where(request)):
                    prompt = self.tokenizer.encode(context) if context else [self.eos_id]
                self._check_prompt(len(prompt), request)
                out.append(self._generate(prompt, _stops(kwargs.get("until")),
                                          int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)),
                                          temperature, top_k, generator))
                self.scored += 1
                if self.progress is not None:
                    self.progress(1)
            return out
        finally:
            model.train(was_training)

    def _generate(self, prompt: list[int], stops: list[str], max_new: int, temperature: float, top_k: int | None,
                  generator: Any) -> str:
        """One cached generation (generation.py's stream_tokens), read as it comes: the text is
        checked for a stop string after 8, 16, 32, ... tokens and at the end, so a stop ends the work
        soon after it appears; the tokens are those of one `generate` call of max_new."""
        from llmtrain.generation import stream_tokens

        ids: list[int] = []
        check_at = 8
        with self.scorer.autocast():
            for token in stream_tokens(self.scorer.model, prompt, max_new, temperature, top_k, generator,
                                       context=self.window, vocab_limit=self.tokenizer.vocab_size, stop_id=self.eos_id):
                ids.append(token)
                if len(ids) == check_at:
                    text = self.tokenizer.decode(ids)
                    cut = _first_stop(text, stops)
                    if cut is not None:
                        return text[:cut]
                    check_at *= 2
        text = self.tokenizer.decode(ids)
        cut = _first_stop(text, stops)
        return text if cut is None else text[:cut]

    @staticmethod
    def _sampling(kwargs: dict[str, Any]) -> tuple[float, int | None]:
        """(temperature, top_k): 0 (greedy) unless the task asks for sampling (do_sample: true, as
        for HFLM; temperature 1 unless given)."""
        if not kwargs.get("do_sample"):
            return 0.0, None
        temperature = float(kwargs.get("temperature", 1.0))
        if temperature <= 0:
            return 0.0, None
        top_k = kwargs.get("top_k")
        return temperature, int(top_k) if top_k else None

    def _fitted(self, pair: tuple[list[int], list[int]], request: Any) -> Request:
        context, continuation = pair
        if len(continuation) > self.window:
            raise UserError(f"{self._where(request)}: a continuation of {len(continuation)} tokens is longer than the "
                            f"model's window of {self.window} tokens, so it cannot be scored.")
        # The model reads all but the last token: more than the window is cut (as the Scorer does).
        self._check_prompt(len(context) + len(continuation) - 1, request)
        return context, continuation

    def _check_prompt(self, length: int, request: Any) -> None:
        if length <= self.window:
            return
        if not self.truncate:
            raise UserError(f"{self._where(request)}: the model would read {length} tokens, more than its window of "
                            f"{self.window} tokens, and eval.truncate=false refuses longer contexts; let them be cut "
                            "from the left (eval.truncate=true) or use a model with a longer context.")
        self.cut += 1

    def _score(self, pairs: list[Request]) -> list[Any]:
        scores = self.scorer.loglikelihood(pairs, self.progress) if pairs else []
        self.scored += len(pairs)
        return scores

    def _where(self, request: Any) -> str:
        task, doc = getattr(request, "task_name", None), getattr(request, "doc_id", None)
        return f"{self.name} ({task or 'task'}, document {doc if doc is not None else '?'})"


def _stops(until: Any) -> list[str]:
    if until is None:
        return []
    if isinstance(until, str):
        return [until] if until else []
    return [s for s in until if isinstance(s, str) and s]


def _first_stop(text: str, stops: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _define_scorer_lm() -> type:
    lm_eval = require_lm_eval()
    from lm_eval.api.model import LM

    return type("ScorerLM", (_Adapter, LM), {
        "__doc__": "llmtrain's model as an lm_eval LM, answering on a Scorer: built from the Scorer, the "
                   "tokenizer, the end-of-text id (the empty context, and what precedes a document) and "
                   f"the window (lm-eval {lm_eval.__version__}).",
        "__module__": __name__,
    })


def scorer_lm_class() -> type:
    """ScorerLM, made on first use (a module attribute from then on)."""
    cls = globals().get("ScorerLM")
    if cls is None:
        cls = globals()["ScorerLM"] = _define_scorer_lm()
    return cls


def __getattr__(name: str) -> Any:
    # ScorerLM subclasses lm_eval's LM, so it is made when first asked for: this module imports
    # (and check_tasks says how to install lm-eval) without it.
    if name == "ScorerLM":
        return scorer_lm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
