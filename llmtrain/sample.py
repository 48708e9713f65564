"""Text generation from a finished run: `llmtrain sample <run dir>`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from llmtrain.config import config_from_dict, seq_len_of
from llmtrain.data.tokenizers import Tokenizer, load_tokenizer
from llmtrain.errors import ConfigError, UserError
from llmtrain.model import GPT


@dataclass
class TrainedRun:
    model: GPT  # in eval mode
    tokenizer: Tokenizer
    context: int  # the sequence length it was trained on: positions past it were never seen


def load_run(run_dir: Path, device: str = "cpu") -> TrainedRun:
    """The trained model, its tokenizer and its training context from a run directory (its final
    weights, else its newest good checkpoint's) or from an `llmtrain export` folder."""
    from llmtrain.export import is_export, load_exported, newest_weights

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(
            f"'{run_dir}' does not exist; give a run directory that `llmtrain train` wrote "
            "(its banner prints it, e.g. outputs/<date>/<time>) or a folder written by `llmtrain export`."
        )
    if is_export(run_dir):
        model, context = load_exported(run_dir, device)
        return TrainedRun(model, load_tokenizer(run_dir / "tokenizer.json"), context)
    needed = [run_dir / name for name in ("config.yaml", "tokenizer.json")]
    missing = [p.name for p in needed if not p.is_file()]
    if missing:
        raise UserError(
            f"'{run_dir}' is not an llmtrain run directory or export: {', '.join(missing)} missing. "
            "Give the directory that `llmtrain train` printed in its banner (e.g. outputs/<date>/<time>)."
        )
    try:
        cfg = config_from_dict(yaml.safe_load(needed[0].read_text()))
    except ConfigError as err:
        raise UserError(f"'{needed[0]}' is not a valid llmtrain config: {err}") from None
    tokenizer = load_tokenizer(needed[1])
    # Weights load with weights_only=True (or as bare tensors from shards): they cannot run code.
    state = newest_weights(run_dir)
    embedding = state.get("wte.weight")
    if embedding is None or embedding.dim() != 2:
        raise UserError(f"'{run_dir}': its weights hold no token embedding (wte.weight), so they are not an llmtrain "
                        "model's; give a run directory that `llmtrain train` wrote.")
    model = GPT(cfg.model, embedding.shape[0])
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[1:2] or [str(err)]
        raise UserError(f"'{run_dir}': its weights do not fit its config.yaml ({first[0].strip()[:300]}).") from None
    return TrainedRun(model.to(device).eval(), tokenizer, seq_len_of(cfg))


@torch.no_grad()
def generate(
    model: GPT,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    context: int | None = None,
    vocab_limit: int | None = None,
    stop_id: int | None = None,
) -> list[int]:
    """Autoregressive sampling; the same generator seed gives the same tokens.

    `context` crops the input to the length the model was trained on; `vocab_limit` keeps ids the
    tokenizer can decode (a model's vocabulary may be padded beyond the tokenizer's, e.g. 50304);
    generation ends after `stop_id` (end-of-text) if it comes.
    """
    device = next(model.parameters()).device
    context = min(context or model.cfg.block_size, model.cfg.block_size)
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        logits = model(idx[:, -context:])[:, -1, :].float()
        if vocab_limit is not None:
            logits[:, vocab_limit:] = float("-inf")
        if temperature <= 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.size(-1):
                kth = torch.topk(logits, top_k).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            next_id = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)
        idx = torch.cat([idx, next_id], dim=1)
        if stop_id is not None and int(next_id) == stop_id:
            break
    return idx[0, len(prompt) :].tolist()


def sample_text(
    run_dir: Path,
    prompt: str = "\n",
    max_new_tokens: int = 400,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    stop_at_end_of_text: bool = True,
) -> str:
    run = load_run(run_dir)
    try:
        prompt_ids = run.tokenizer.encode(prompt) if prompt else [0]
    except ValueError as err:
        raise UserError(f"The prompt {prompt!r} cannot be encoded: {err}.") from None
    generator = torch.Generator().manual_seed(seed)
    ids = generate(
        run.model, prompt_ids, max_new_tokens, temperature, top_k, generator,
        context=run.context, vocab_limit=run.tokenizer.vocab_size,
        stop_id=run.tokenizer.eos_id if stop_at_end_of_text else None,
    )
    return run.tokenizer.decode(ids)
