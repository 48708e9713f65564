"""Text generation from a trained run: `llmtrain sample <run dir or export folder>`.

`generate` is the sampling loop (the report's inference check and the evaluation harness use it
too): a prefill of the prompt, then one token per forward through the model's KV cache
(`GPT.decode`); `stream_tokens` gives the same tokens as they come. `sample_text` loads the run
through runs/artifacts.py and decodes what `generate` returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from llmtrain.core.errors import UserError
from llmtrain.data.tokenizers import Utf8Guard
from llmtrain.model import GPT, param_count
from llmtrain.model_tensors import model_tensors
from llmtrain.preflight.estimate import available_memory, format_bytes
from llmtrain.runs.artifacts import TrainedRun, load_run


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
    guard: Utf8Guard | None = None,
) -> list[int]:
    """Autoregressive sampling with a KV cache (`stream_tokens`); the same generator seed gives the
    same tokens, temperature <= 0 the greedy ones.

    `context` is the window the model reads (default and most: its block_size; give the length it
    was trained on): a longer prompt is cut to its last `context` tokens. While prompt and text fit
    the window the tokens are those of recomputing the whole sequence for every token (to float
    rounding). Past it the window moves in jumps, by design: when the cache is full it is refilled
    with the last context // 2 tokens (one forward of them), so each token reads between half and
    all of a window instead of exactly the last `context` tokens, and positions never go past the
    trained window. Splitting one call into several therefore gives other tokens past the window.
    `vocab_limit` keeps ids the tokenizer can decode (a model's vocabulary may be padded beyond the
    tokenizer's, e.g. 50304); generation ends after `stop_id` (end-of-text) if it comes. `guard` (a
    byte model's `Utf8Guard`) keeps the bytes valid UTF-8; the last character may be unfinished when
    `max_new_tokens` ends it (`guard.pending` bytes of it).
    """
    return list(stream_tokens(model, prompt, max_new_tokens, temperature, top_k, generator, context, vocab_limit,
                              stop_id, guard))


@torch.no_grad()  # entered at each step of the iteration only, never around the caller's code; not
# inference_mode: FSDP2's unshard hooks fail on inference tensors (an eval task during fsdp training)
def stream_tokens(
    model: GPT,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    context: int | None = None,
    vocab_limit: int | None = None,
    stop_id: int | None = None,
    guard: Utf8Guard | None = None,
) -> Iterator[int]:
    """`generate`'s tokens one at a time, as they come (a caller may stop early, e.g. at a stop string)."""
    if not prompt:
        raise ValueError("generation needs a prompt of at least one token (e.g. the end-of-text id)")
    if max_new_tokens < 1:
        return
    device = next(model.parameters()).device
    window = min(context or model.cfg.block_size, model.cfg.block_size)
    keep = max(1, window // 2)
    cache = model.new_cache(window)
    tokens = list(prompt[-window:])  # what a refill may need: the last window of the sequence
    logits = model.decode(torch.tensor([tokens], dtype=torch.long, device=device), cache)
    for produced in range(1, max_new_tokens + 1):
        next_id = _pick(logits if logits.dtype == torch.float32 else logits.float(), temperature, top_k,
                        generator, vocab_limit, guard)
        if guard is not None:
            guard.advance(next_id)
        yield next_id
        if produced == max_new_tokens or next_id == stop_id:
            return
        if cache.length == cache.capacity:  # full: start again from the last half window
            tokens = tokens[-(keep - 1):] + [next_id] if keep > 1 else [next_id]
            cache.reset()
            step = torch.tensor([tokens], dtype=torch.long, device=device)
        else:
            tokens.append(next_id)
            step = torch.tensor([[next_id]], dtype=torch.long, device=device)
        logits = model.decode(step, cache)


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None,
          vocab_limit: int | None, guard: Utf8Guard | None = None) -> int:
    """The next token from the logits (1, vocab): the likeliest at temperature <= 0, else sampled;
    never an id at or past `vocab_limit` or one `guard` bans."""
    if vocab_limit is not None:
        logits[:, vocab_limit:] = float("-inf")
    if guard is not None:
        logits[:, torch.from_numpy(guard.banned(logits.shape[-1])).to(logits.device)] = float("-inf")
    if temperature < torch.finfo(logits.dtype).tiny:  # 0, or too small to divide by in this dtype: greedy
        return int(logits.argmax(dim=-1))
    # The largest logit subtracted first: a tiny temperature then sends the others to -inf, never the
    # largest to +inf (inf - inf would make every probability NaN).
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


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


# Below this many parameters a model generates on one CPU thread (see generation_threads).
ONE_THREAD_BELOW = 20_000_000


def generation_threads(model: GPT, threads: int) -> int:
    """CPU threads to generate with: 1 for a model under ONE_THREAD_BELOW parameters, else `threads`.
    One token's matmuls of a small model take microseconds, less than handing each of the ~15 ops
    per layer to a second thread and waiting for it, which is far worse when other work holds the
    cores: 500 tokens of gpt_tiny took 12-15 s with 2 threads on 2 busy cores and 0.5 s with 1."""
    if next(model.parameters()).device.type != "cpu":
        return threads
    return 1 if param_count(model) < ONE_THREAD_BELOW else threads
