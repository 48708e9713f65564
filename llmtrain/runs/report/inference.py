"""Does inference behave like training? The final weights reloaded through engine/modes.py's probe
(the one the pre-flight check and `llmtrain doctor eval-consistency` run): eval mode twice, train mode
with dropout off, and a few sampled tokens (`inference`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from llmtrain.core.errors import UserError
from llmtrain.core.files import (
    TOKENIZER,
)
from llmtrain.core.findings import Finding
from llmtrain.runs.report.verdict import NA, OK, WARN, Verdict

QUESTION = "Does inference behave like training?"


def skipped() -> Verdict:
    """The answer when the report was asked not to reload the weights."""
    return Verdict("inference", Finding(QUESTION, NA, "skipped (--no-inference)."))


def inference(run_dir: Path, cfg: Any) -> Verdict:
    """Reload the final weights; eval twice (identical), train mode with dropout off (equal to eval),
    a few sampled tokens."""
    if cfg is None:
        return _not_checked("config.yaml is missing or unreadable; cannot rebuild the model.")
    import torch

    from llmtrain.data.cache import cached_data
    from llmtrain.engine.modes import probe_modes
    from llmtrain.model import GPT
    from llmtrain.runs.artifacts import newest_weights

    try:  # weights that are not exactly config.yaml's model are passed over: nothing of a forged size is built
        state = newest_weights(run_dir, warn=lambda message: None, model=cfg.model)
        data = cached_data(cfg.data)
    except Exception as err:  # noqa: BLE001 - unreadable weights or data: this question has no answer, the others do
        return _not_checked(f"not checked: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
                            if str(err) else f"not checked: {type(err).__name__}")
    if data is None:  # a report never tokenizes a corpus: that is `llmtrain prepare`'s job
        return _not_checked("not checked: the run's prepared data is not in the cache (deleted, or the corpus changed "
                            "since); `llmtrain prepare` with the run's data settings brings it back.")
    vocab = state["wte.weight"].shape[0]
    model = GPT(cfg.model, vocab)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:  # e.g. an old model.pt left in a reused run dir
        first = (str(err).strip().splitlines()[1:2] or [str(err)])[0].strip()[:300]
        return _not_checked(f"not checked: the weights do not fit config.yaml ({first})")
    tokens = data.tokens("val")
    if len(tokens) < 3:
        tokens = data.tokens("train")
    length = min(cfg.model.block_size, len(tokens) - 1, 128)
    count = max(1, min(4, (len(tokens) - 1) // length))
    x = torch.stack([torch.from_numpy(tokens[i * length:(i + 1) * length].astype("int64")) for i in range(count)])
    no_dropout = GPT(_without_dropout(cfg.model), vocab)
    no_dropout.load_state_dict(state)
    # Train mode with dropout on is random by design: the probe's noise measurement is not asked for.
    probe = probe_modes(model, x, no_dropout, noise=False)
    identical, difference = probe.eval_identical, probe.eval_vs_train
    model.eval()  # sampled as `llmtrain sample` samples
    text = _sample_text(run_dir, model, [int(t) for t in x[0, :32]], cfg)
    details = [f"{count} validation sequence(s) of {length} tokens through the reloaded final weights.",
               f"eval mode twice: {'identical' if identical else 'DIFFERENT'} logits.",
               f"eval mode vs train mode with dropout off: largest logit difference {difference:.2e}.",
               f"model.dropout={cfg.model.dropout:g} (train mode with dropout on is stochastic by design)."]
    if text:
        details.append(f"sampled continuation (temperature 1): {text}")
    if not identical or not probe.eval_matches_train():
        what = "eval mode is not deterministic" if not identical else "train mode (dropout off) differs from eval mode"
        return Verdict("inference", Finding(
            QUESTION, WARN, f"{what} (largest logit difference {difference:.2e}): a layer behaves differently by mode "
            "beyond dropout (e.g. a norm with running statistics, a mode-dependent branch).", details=details))
    return Verdict("inference", Finding(
        QUESTION, OK, "yes: the reloaded weights give identical logits in eval mode twice, and train mode with "
        f"dropout off matches eval mode (largest difference {difference:.1e}).", details=details))


def _not_checked(why: str) -> Verdict:
    return Verdict("inference", Finding(QUESTION, NA, why))


def _without_dropout(model_cfg: Any) -> Any:
    return dataclasses.replace(model_cfg, dropout=0.0)


def _sample_text(run_dir: Path, model: Any, prompt: list[int], cfg: Any) -> str:
    """A validation prompt and 48 sampled tokens (temperature 1, seed 0), decoded; "" without a
    readable tokenizer.json."""
    import torch

    from llmtrain.data.tokenizers import load_tokenizer
    from llmtrain.generation import generate

    try:
        tokenizer = load_tokenizer(run_dir / TOKENIZER)
    except (OSError, ValueError, KeyError, UserError):
        return ""
    continuation = generate(model, prompt, 48, temperature=1.0, generator=torch.Generator().manual_seed(0),
                            context=cfg.model.block_size, vocab_limit=tokenizer.vocab_size, stop_id=tokenizer.eos_id)
    text = f"{tokenizer.decode(prompt)!r} -> {tokenizer.decode(continuation)!r}"
    return text[:400]
