"""The pre-flight items about the data: its content (degenerate files, one token dominating), its order,
the vocabulary against the data's, and the token budget against the model's size.

Each item is a function of (config, facts) giving a `Finding` (or None where it does not apply);
preflight/check.py lists them in the order the table shows."""

from __future__ import annotations

import dataclasses
import math

from llmtrain.config.derived import (
    model_vocab_size,
    tokens_per_step,
    total_steps,
)
from llmtrain.config.schema import (
    Config,
    DataSource,
)
from llmtrain.core.errors import UserError
from llmtrain.core.findings import Finding, Status
from llmtrain.data import quality
from llmtrain.data.cache import source_files
from llmtrain.preflight.estimate import (
    estimate_memory,
    format_bytes,
    model_shape,
)
from llmtrain.preflight.facts import TOKENS_PER_PARAM, Facts
from llmtrain.preflight.parameters import WITHOUT_EMBEDDINGS

# An explicit model.vocab_size this many times the data's vocabulary (and 64+ ids above it) warns:
# the unused rows cost weights, optimizer state and, above all, logits memory and head FLOPs.
VOCAB_WASTE_FACTOR = 2


def check_data_content(cfg: Config, facts: Facts) -> Finding | None:
    """Data that is not text (NUL bytes, whitespace only, one repeated token, binary files, text in
    another encoding): warn, naming the files. From the prepared data's meta; before it is
    prepared, from the first MB of each text file."""
    meta = facts.data_meta
    if meta is None and cfg.data.source is DataSource.python_stdlib:
        return Finding("data content", Status.PASS, "Python's own sources (judged in full once prepared)",
                       "The embedded default corpus is ordinary text.")
    if meta is None:
        sampled = _sampled_degenerate_files(cfg)
        if sampled is None:
            return None  # not text files, or unreadable: judged once the data is prepared
        files, count = sampled
        seen = f"not prepared yet: the first {quality.SAMPLE_BYTES // 2**20} MB of each file look like text"
    else:
        files, count = meta.get("degenerate_files", []), int(meta.get("degenerate_file_count", 0))
        seen = (f"unigram entropy {float(meta['unigram_entropy_nats']):.2f} nats/token"
                + (f", most common token {meta['dominant_token']} {float(meta['dominant_token_share']):.0%}"
                   if "dominant_token_share" in meta else ""))
    why = ("Data that is not text teaches a text model nothing it will use: near-constant files (NUL bytes, only "
           "whitespace, one token repeated) train to a loss that looks fine, binary or wrongly encoded files to "
           "noise.")
    fix = "remove or replace the named file(s), or convert them to UTF-8 as each one says"
    problems = [quality.describe(f) for f in files]
    if count > len(files):
        problems.append(f"and {count - len(files)} more file(s)")
    if not problems and meta is not None:  # no file stands out: the corpus as a whole may
        problems = _corpus_problems(meta)
    if problems:
        return Finding("data content", Status.WARN, "; ".join(problems), why, fix)
    return Finding("data content", Status.PASS, seen, why)


def _corpus_problems(meta: dict) -> list[str]:
    """The prepared train split as a whole: near-constant tokens, one token dominating."""
    found = []
    entropy = float(meta.get("unigram_entropy_nats", math.inf))
    share = float(meta.get("dominant_token_share", 0.0))
    if entropy < quality.LOW_ENTROPY_NATS:
        found.append(f"the train split's unigram entropy is {entropy:.2f} nats/token (text has ~2-5)")
    if share > quality.DOMINANT_SHARE:
        found.append(f"one token, {meta.get('dominant_token', '?')}, is {share:.0%} of the train tokens")
    if float(meta.get("replacement_share", 0.0)) > quality.REPLACEMENT_SHARE:
        found.append(f"{float(meta['replacement_share']):.0%} of the characters are undecodable (U+FFFD)")
    return found


def _sampled_degenerate_files(cfg: Config) -> tuple[list[dict], int] | None:
    """Degenerate files among a not yet prepared text corpus, judged on a sample of each file."""
    if cfg.data.source is not DataSource.text:
        return None
    try:
        return quality.sample_degenerate_files([(f.name, f.path) for f in source_files(cfg.data)])
    except (OSError, UserError):
        return None


def check_data_order(cfg: Config, facts: Facts) -> Finding:
    d = cfg.data
    seed = d.seed if d.seed is not None else cfg.seed
    order = ("epochs (new order each epoch)" if d.sampling.value == "epoch"
             else f"random windows, shuffle={str(d.shuffle).lower()}")
    seen = f"{order}, data seed {seed if seed is not None else 'drawn at random'}" + (
        f", overfit_batches={d.overfit_batches}" if d.overfit_batches else "")
    why = "Unshuffled data gives correlated batches and a biased path; an unfixed seed makes the order unrepeatable."
    if d.overfit_batches:
        return Finding("data order", Status.WARN, seen,
                       "A debugging run: it replays the same batches and cannot generalize.",
                       "data.overfit_batches=0 for real training")
    if not d.shuffle and d.sampling.value == "random":
        return Finding("data order", Status.WARN, seen, why, "data.shuffle=true")
    if seed is None:
        return Finding("data order", Status.WARN, seen, why, "seed=1337 (or data.seed=N)")
    return Finding("data order", Status.PASS, seen, why)


def check_vocabulary(cfg: Config, facts: Facts) -> Finding:
    """An explicit model.vocab_size far above the data's: rows no token uses, paid for in every step."""
    data = facts.data_vocab
    model = facts.vocab_size
    origin = ("model.vocab_size" if cfg.model.vocab_size is not None
              else f"the data's, padded to a multiple of {cfg.model.vocab_multiple}")
    seen = f"{model:,} ids ({origin}); the data has " + (f"{data:,}" if data is not None else "an unknown number")
    why = "The model needs an id for every token of the data; each id beyond costs weights, optimizer state and logits."
    if data is None or cfg.model.vocab_size is None or model < VOCAB_WASTE_FACTOR * data or model - data < 64:
        return Finding("vocabulary", Status.PASS, seen, why)
    unused = model - data
    # what the data's own vocabulary would cost, padded as gpt_small pads it
    lean_model = dataclasses.replace(cfg.model, vocab_size=None, vocab_multiple=64)
    padded = model_vocab_size(dataclasses.replace(cfg, model=lean_model), data)
    lean_shape = model_shape(cfg, padded)
    lean = estimate_memory(cfg, lean_shape, padded, facts.device.type, facts.precision,
                           runtime_bytes=facts.memory.runtime, data_bytes=facts.memory.data)
    extra = facts.memory.peak - lean.peak
    rows = unused * cfg.model.n_embd * (1 if cfg.model.tie_weights else 2)
    flops = 1 - lean_shape.flops_per_token / facts.shape.flops_per_token
    return Finding("vocabulary", Status.WARN, f"{seen}: {unused:,} ids are never used",
                   f"They add {rows:,} parameters and ~{format_bytes(max(0.0, extra))} to the peak memory (logits, "
                   f"weights, gradients, optimizer state), and {flops:.0%} of each step's FLOPs.",
                   f"model.vocab_size=null model.vocab_multiple=64 ({padded:,} ids)")


def check_token_budget(cfg: Config, facts: Facts) -> Finding:
    steps = total_steps(cfg)
    tokens = steps * tokens_per_step(cfg)
    if facts.shape.adapter_params:
        return Finding("token budget", Status.NA, f"{tokens:,} tokens for {facts.shape.adapter_params:,} LoRA adapter "
                       "parameters", f"~{TOKENS_PER_PARAM} tokens per parameter is a rule for training a model from "
                       "scratch, not for fine-tuning adapters.")
    n = facts.parameters.without_embeddings
    per_param = facts.parameters.tokens_per_param(tokens)
    seen = f"{tokens:,} tokens for {n:,} parameters {WITHOUT_EMBEDDINGS} = {per_param:.1f} tokens/param"
    why = (f"Compute-optimal training is ~{TOKENS_PER_PARAM} tokens per parameter; far fewer undertrains, many epochs "
           "overfit.")
    if facts.train_tokens:
        epochs = tokens / facts.train_tokens
        seen += f", {epochs:.2g} epochs"
        if epochs > 20 and not cfg.data.overfit_batches:
            return Finding("token budget", Status.WARN, seen, "Over 20 passes over the data: the model memorizes it.",
                           "more data, or fewer steps")
    if per_param < 1:
        more = (f"max_tokens={TOKENS_PER_PARAM * n}" if cfg.max_tokens is not None
                else f"max_steps={max(steps, int(TOKENS_PER_PARAM * n / max(1, tokens / steps)))}")
        return Finding("token budget", Status.WARN, seen, why,
                       f"{more} ({TOKENS_PER_PARAM} tokens/param) or a smaller model")
    return Finding("token budget", Status.PASS, seen, why)
