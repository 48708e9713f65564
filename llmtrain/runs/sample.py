"""Text generation from a trained run: `llmtrain sample <run dir or export folder>`.

`generate` is the sampling loop (the report's inference check uses it too); `sample_text` loads the
run through runs/artifacts.py and decodes what `generate` returns.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmtrain.errors import UserError
from llmtrain.model import GPT
from llmtrain.runs.artifacts import load_run


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
    """`max_new_tokens` sampled after `prompt` (seeded: the same seed gives the same text), decoded."""
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
