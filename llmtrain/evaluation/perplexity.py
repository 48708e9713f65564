"""Held-out perplexity: `perplexity:PATH` (a text file, a folder, a glob or .jsonl files), the
perplexity of `data=... data.path=...`, and the run's own validation split.

Each document is scored on its own, as the lm-evaluation-harness's loglikelihood_rolling does: its
first token is predicted from end-of-text (what precedes every document in training) and windows
of the model's context tile it exactly once (`rolling_requests`; eval.stride < window gives every
token more context). The metrics are per token (loss, perplexity) and per UTF-8 byte of the text
(bits_per_byte), the latter comparable between models with different tokenizers.
"""

from __future__ import annotations

import glob
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmtrain.config.eval_tasks import TASK_BYTES, TaskSpec, encodable, target_problem
from llmtrain.core.errors import ConfigError, UserError

if TYPE_CHECKING:
    from llmtrain.config.schema import DataConfig, EvalConfig
    from llmtrain.data.cache import PreparedData
    from llmtrain.data.corpus import SourceFile
    from llmtrain.data.tokenizers import Tokenizer
    from llmtrain.evaluation.scoring import Scorer

# Texts tokenized per call of a batch tokenizer (BPE's encode_arrays runs them on all cores).
TEXTS_PER_ENCODE = 256


@dataclass(frozen=True)
class Document:
    where: str  # the file, or file:line for JSON lines: what an error names
    text: str


class PerplexityTask:
    """Tokenized documents, ready to score: `run` gives loss, perplexity, bits_per_byte, tokens,
    bytes and documents."""

    def __init__(self, spec: TaskSpec, documents: list[np.ndarray], total_bytes: int, window: int,
                 stride: int, eos_id: int) -> None:
        self.spec, self.documents, self.total_bytes = spec, documents, total_bytes
        self.window, self.stride, self.eos_id = window, stride, eos_id
        self.size = sum(request_count(len(ids), window, stride) for ids in documents)

    def run(self, scorer: Scorer, progress: Callable[[int], None] | None = None) -> dict[str, float | int]:
        from llmtrain.evaluation.scoring import REQUESTS_PER_CALL_PER_BATCH, rolling_requests

        logprob, tokens = 0.0, 0
        pending: list = []
        chunk = scorer.batch_size * REQUESTS_PER_CALL_PER_BATCH

        def flush() -> None:
            nonlocal logprob, tokens
            for score in scorer.loglikelihood(pending, progress, greedy=False):
                logprob += score.logprob
                tokens += score.tokens
            pending.clear()

        for ids in self.documents:
            for request in rolling_requests(ids, self.eos_id, self.window, self.stride):
                pending.append(request)
                if len(pending) >= chunk:  # also inside a long document: memory stays bounded
                    flush()
        flush()
        if tokens == 0:
            raise UserError(f"{self.spec.name}: the tokenizer turned the text into no tokens at all (it drops "
                            "characters it does not know), so there is nothing to score; give text in the model's "
                            "alphabet.")
        loss = -logprob / tokens
        perplexity = math.exp(loss) if loss < 709.0 else math.inf  # a diverged model: exp would overflow
        return {"loss": loss, "perplexity": perplexity, "bits_per_byte": -logprob / math.log(2) / self.total_bytes,
                "tokens": tokens, "bytes": self.total_bytes, "documents": len(self.documents)}


def request_count(length: int, window: int, stride: int) -> int:
    """How many requests `rolling_requests` makes for a document of `length` tokens."""
    return 0 if length == 0 else 1 + len(range(window, length, stride))


def checked_stride(stride: int | None, window: int) -> int:
    if stride is not None and stride > window:
        raise ConfigError(f"'eval.stride' is {stride}, more than the model's window of {window} tokens; use 1 to "
                          f"{window}, or null for non-overlapping windows.")
    return window if stride is None else stride


class TextSource:
    """Held-out documents as text (read and checked, not tokenized)."""

    def __init__(self, spec: TaskSpec, documents: list[Document], stride: int | None, replaced: int = 0) -> None:
        self.spec, self.documents, self.stride, self.replaced = spec, documents, stride, replaced

    def encode(self, tokenizer: Tokenizer, window: int, eos_id: int, truncate: bool,
               log: Callable[[str], None]) -> PerplexityTask:
        stride = checked_stride(self.stride, window)
        if self.replaced:
            log(f"{self.spec.name}: {self.replaced} document(s) are not valid UTF-8; their invalid bytes were read as "
                "U+FFFD, as data preparation reads them")
        ids = encode_texts(tokenizer, self.documents)
        total_bytes = sum(len(d.text.encode("utf-8")) for d in self.documents)
        return PerplexityTask(self.spec, ids, total_bytes, window, stride, eos_id)


def encode_texts(tokenizer: Tokenizer, documents: list[Document]) -> list[np.ndarray]:
    """Each document's ids as a uint32 array, with the tokenizer's fastest encoder: the one data
    preparation uses (the same ids as `encode`)."""
    from llmtrain.data.tokenizers import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):  # its ids are the UTF-8 bytes: no per-token Python int
        return [np.frombuffer(d.text.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for d in documents]
    batch = getattr(tokenizer, "encode_arrays", None)
    single = getattr(tokenizer, "encode_array", None)
    out: list[np.ndarray] = []
    if batch is not None:
        for start in range(0, len(documents), TEXTS_PER_ENCODE):
            part = documents[start:start + TEXTS_PER_ENCODE]
            with encodable(part[0].where if len(part) == 1 else f"{part[0].where} (or a document after it)"):
                out += [np.asarray(a, dtype=np.uint32) for a in batch([d.text for d in part])]
        return out
    for document in documents:
        with encodable(document.where):
            ids = single(document.text) if single is not None else tokenizer.encode(document.text)
        out.append(np.asarray(ids, dtype=np.uint32))
    return out


def read_perplexity(spec: TaskSpec, cfg: EvalConfig) -> TextSource:
    """perplexity:PATH: every document of the file(s), the first eval.limit of them; UserError for a
    path that names nothing, a bad JSON line (file:line) or no text at all."""
    files = held_out_files(spec)
    documents, replaced = read_documents(files_documents(files, cfg.text_field, "eval.text_field"), cfg.limit,
                                         spec.name)
    if not documents:
        raise UserError(f"'{spec.name}': {spec.target} holds no text (every document in it is empty); give held-out "
                        "text to score.")
    return TextSource(spec, documents, cfg.stride, replaced)


def held_out_files(spec: TaskSpec) -> list[SourceFile]:
    """The files of perplexity:PATH, in llmtrain's corpus order: one file, a folder's .txt/.md/.text
    and .jsonl files (recursively) or a glob's matches. A .jsonl file is JSON lines, any other text."""
    from llmtrain.data.corpus import input_files

    path = Path(spec.target)
    magic = glob.has_magic(spec.target)
    problem = None if magic or path.is_dir() else target_problem(spec)  # a FIFO or a device: never opened
    if problem is not None:
        raise UserError(f"'{spec.name}': {spec.target} {problem}; give a text file, a .jsonl file, a folder of them, "
                        "or a glob like 'held_out/*.txt'.")
    files = []
    for source in ("text",) if magic or path.is_file() else ("text", "jsonl"):
        try:
            files += input_files(spec.target, source)
        except ConfigError:
            pass  # none of this kind (or only empty ones): the other kind may have some
    if not files:
        where = ("matches no file with text" if magic else "is empty" if path.is_file()
                 else "has no .txt, .md, .text or .jsonl file with text in it (searched recursively)")
        raise UserError(f"'{spec.name}': {spec.target} {where}; give held-out text (a file, a folder or a glob).")
    return files


def files_documents(files: list[SourceFile], text_field: str, field_key: str,
                    is_jsonl: Callable[[SourceFile], bool] = lambda f: f.path.suffix.lower() == ".jsonl",
                    ) -> Iterator[tuple[str, bytes]]:
    """(where, bytes) of each non-empty document, read as data preparation reads them: a text file is
    one document (UTF-16/32 with a byte-order mark decoded), each line of a JSON-lines file (by
    default: a .jsonl file) one, its `text_field`. `field_key` is the key named in a JSON error."""
    from llmtrain.data.corpus import document_pieces, jsonl_documents

    for f in files:
        if not is_jsonl(f):
            size = f.path.stat().st_size
            if size > TASK_BYTES:  # one document, read whole: refused before it is read
                raise UserError(f"{f.path} is {size / 2**30:,.1f} GB, one document more than the "
                                f"{TASK_BYTES >> 30} GB of text a task holds in memory to score; give a part of it.")
            yield str(f.path), b"".join(piece for _, piece, _ in document_pieces([f], None))
            continue
        try:
            for name, data in jsonl_documents(f, text_field):
                yield f"{f.path}{name[len(f.name):]}", data  # name is file:line
        except ConfigError as err:  # its advice names data.text_field; for eval.tasks the key is another
            raise ConfigError(str(err).replace("data.text_field", field_key)) from None


def read_documents(documents: Iterable[tuple[str, bytes]], limit: int | None, name: str,
                   skip_invalid: bool = False) -> tuple[list[Document], int]:
    """The first `limit` non-empty documents as text, and how many were not valid UTF-8 (their bad
    bytes become U+FFFD, data.decode_errors=replace; with `skip_invalid` they are left out). More
    than TASK_BYTES of them is refused, `name` (the task's entry) saying what."""
    out, replaced, held = [], 0, 0
    for where, data in documents:
        if limit is not None and len(out) >= limit:
            break
        held += len(data)
        if held > TASK_BYTES:
            raise UserError(f"'{name}' holds more than {TASK_BYTES >> 30} GB of text by {where}, more than a task "
                            "holds in memory to score; set eval.limit=N to score its first N documents, or give a "
                            "part of it.")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            if skip_invalid:
                continue
            text, replaced = data.decode("utf-8", errors="replace"), replaced + 1
        if text:
            out.append(Document(where, text))
    return out, replaced


def data_source(data_cfg: DataConfig, cfg: EvalConfig | None = None) -> TextSource:
    """The perplexity of `data=text|jsonl|hf data.path=...` (named perplexity:<data.path>, or
    perplexity:<data.hf_name>): its whole text, every document scored (eval.limit: the first N)."""
    from llmtrain.config.schema import DataSource, DecodeErrors

    limit, stride = (cfg.limit, cfg.stride) if cfg is not None else (None, None)
    skip = data_cfg.decode_errors is DecodeErrors.skip
    if data_cfg.source in (DataSource.text, DataSource.jsonl):
        from llmtrain.data.corpus import input_files

        if not data_cfg.path:
            raise ConfigError(f"data={data_cfg.source.value} needs data.path: the held-out file, folder or glob "
                              "to score.")
        files = input_files(data_cfg.path, data_cfg.source.value)  # its errors name data.path, as here
        # As prepare reads them: data=text files are text whatever their names, data=jsonl files JSON lines.
        jsonl = data_cfg.source is DataSource.jsonl
        pieces: Iterable[tuple[str, bytes]] = files_documents(files, data_cfg.text_field, "data.text_field",
                                                              lambda f: jsonl)
        spec = TaskSpec("perplexity", data_cfg.path, f"perplexity:{data_cfg.path}")
    elif data_cfg.source is DataSource.hf:
        from llmtrain.data.corpus import hf_documents, load_hf_dataset

        assert data_cfg.hf_name is not None  # config validation requires it for data=hf
        dataset = load_hf_dataset(data_cfg.hf_name, data_cfg.hf_config, data_cfg.hf_split, data_cfg.path,
                                  data_cfg.text_field)
        pieces = hf_documents(dataset, data_cfg.hf_split, data_cfg.text_field)
        spec = TaskSpec("perplexity", data_cfg.hf_name, f"perplexity:{data_cfg.hf_name}")
    else:
        raise ConfigError(
            f"data={data_cfg.source.value} cannot be evaluated as held-out text: give data=text data.path=FILE "
            "(a file, folder or glob of text), data=jsonl data.path=FILE (data.text_field names the field) or data=hf "
            "data.hf_name=..., or name files in eval.tasks=[perplexity:FILE]; perplexity:validation is the run's own "
            "validation split.")
    documents, replaced = read_documents(pieces, limit, spec.name, skip)
    if not documents:
        raise UserError(f"{spec.name[len('perplexity:'):]} holds no text (every document is empty); "
                        "give held-out text.")
    return TextSource(spec, documents, stride, replaced)


class ValidationSource:
    """The run's validation split: its token stream cut into documents at end-of-text."""

    def __init__(self, spec: TaskSpec, documents: list[np.ndarray], stride: int | None) -> None:
        self.spec, self.documents, self.stride = spec, documents, stride

    def encode(self, tokenizer: Tokenizer, window: int, eos_id: int, truncate: bool,
               log: Callable[[str], None]) -> PerplexityTask:
        # The bytes of the text the tokens stand for, so bits per byte compares with other tokenizers.
        total_bytes = sum(len(tokenizer.decode(ids.tolist()).encode("utf-8")) for ids in self.documents)
        return PerplexityTask(self.spec, self.documents, total_bytes, window,
                              checked_stride(self.stride, window), eos_id)


def validation_source(data: PreparedData, cfg: EvalConfig | None = None) -> ValidationSource:
    """perplexity:validation: the documents of the prepared data's val split (the first eval.limit),
    each scored on its own as held-out text is. UserError for instruction data (its prompts are not
    scored in training) and for an empty split."""
    from llmtrain.config.eval_tasks import VALIDATION

    if data.meta.get("loss_mask"):
        raise UserError(f"{VALIDATION.name}: the run's data is instruction data (only the responses are trained on), "
                        "so its validation split is not held-out text to score as a whole; name a held-out file "
                        "instead: eval.tasks=[perplexity:FILE] or data=text data.path=FILE.")
    if int(data.meta.get("val_tokens", 0)) == 0:
        raise UserError(f"{VALIDATION.name}: the run's validation split has no tokens (data.val_fraction is too small "
                        "for its corpus, or the data has a single document); name a held-out file instead: "
                        "eval.tasks=[perplexity:FILE] or data=text data.path=FILE.")
    stream = data.tokens("val")
    eos = data.meta.get("end_of_text_id")
    ends = np.flatnonzero(stream == eos) if eos is not None else np.zeros(0, dtype=np.int64)
    limit = cfg.limit if cfg is not None else None
    documents, start = [], 0
    for end in [*ends.tolist(), len(stream)]:
        if limit is not None and len(documents) >= limit:
            break
        if end > start:  # views of the memory-mapped file: nothing copied
            documents.append(stream[start:end])
        start = end + 1
    if not documents:
        raise UserError(f"{VALIDATION.name}: the run's validation split holds no text (only end-of-text tokens); "
                        "name a held-out file instead: eval.tasks=[perplexity:FILE] or data=text data.path=FILE.")
    return ValidationSource(VALIDATION, documents, cfg.stride if cfg is not None else None)
