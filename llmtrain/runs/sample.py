"""Text generation from a trained run: `llmtrain sample <run dir or export folder>`.

`sample_text` loads the run through runs/artifacts.py, checks that a whole window's KV cache fits,
and decodes what llmtrain/generation.py's `generate` (the sampling loop) returns.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmtrain.core.errors import UserError
from llmtrain.data.tokenizers import Utf8Guard
from llmtrain.generation import generate, generation_threads
from llmtrain.model_tensors import model_tensors
from llmtrain.preflight.estimate import available_memory, format_bytes
from llmtrain.runs.artifacts import TrainedRun, load_run


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
    saved_threads = torch.get_num_threads()
    # Loading is small copies (tensor by tensor) that a second thread only slows, much so on busy cores.
    torch.set_num_threads(1)
    try:
        run = load_run(run_dir)
        _check_cache_fits(run)
        try:
            prompt_ids = run.tokenizer.encode(prompt) if prompt else [0]
        except ValueError as err:
            raise UserError(f"The prompt {prompt!r} cannot be encoded: {err}.") from None
        generator = torch.Generator().manual_seed(seed)
        torch.set_num_threads(generation_threads(run.model, saved_threads))
        token_bytes = run.tokenizer.token_bytes()
        guard = Utf8Guard(token_bytes) if token_bytes is not None else None
        ids = generate(
            run.model, prompt_ids, max_new_tokens, temperature, top_k, generator,
            context=run.context, vocab_limit=run.tokenizer.vocab_size,
            stop_id=run.tokenizer.eos_id if stop_at_end_of_text else None, guard=guard,
        )
    finally:
        torch.set_num_threads(saved_threads)
    while guard is not None and guard.pending > 0 and ids:  # the last character was cut off by max_new_tokens
        guard.pending -= len(guard.token_bytes[ids.pop()] or b"")  # (with the tokens that began it)
    return run.tokenizer.decode(ids)


def _check_cache_fits(run: TrainedRun) -> None:
    """The KV cache of a whole window fits in free memory (a config read from a file may give a
    context of 10**9 positions that no weight contradicts, with RoPE)."""
    window = min(run.context, run.model.cfg.block_size)
    need = model_tensors(run.model.cfg, run.model.vocab_size).kv_cache_bytes(window)
    free, source = available_memory(next(run.model.parameters()).device)
    if need > free:
        raise UserError(f"generating with a context of {window:,} tokens needs a {format_bytes(need)} cache, more than "
                        f"the {format_bytes(free)} free here ({source}); the model's context (block_size) is not one "
                        "this machine can generate with.")
