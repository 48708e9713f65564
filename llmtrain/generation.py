"""Text generation from a model: the sampling loop over its KV cache.

`generate` (used by `llmtrain sample`, the report's inference check and the evaluation harness) is a
prefill of the prompt, then one token per `GPT.forward(idx, cache)`: the model's one forward, whose
attention reads and extends the cache; `stream_tokens` gives the same tokens as they come. It sits
in the model layer: it imports only torch, the standard library and llmtrain.model (a tokenizer's
UTF-8 guard comes in through the `TokenGuard` protocol, not the data package).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.nn.modules import module as torch_module

from llmtrain.model import GPT, param_count


class TokenGuard(Protocol):
    """What generation asks of a guard on the next token (data/tokenizers.py's Utf8Guard keeps a
    byte-level model's text valid UTF-8)."""

    def banned(self, size: int) -> Any:  # a numpy bool array over `size` ids: True where an id may not come next
        ...

    def advance(self, token: int) -> None:
        ...


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
    guard: TokenGuard | None = None,
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
    `max_new_tokens` ends it (`guard.pending` bytes of it). Generate with the model in eval mode:
    dropout follows the model's mode, as in any forward.
    """
    return list(stream_tokens(model, prompt, max_new_tokens, temperature, top_k, generator, context, vocab_limit,
                              stop_id, guard))


@torch.no_grad()  # entered at each step of the iteration only, never around the caller's code
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
    guard: TokenGuard | None = None,
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
    mode = _inference_mode(model)
    tokens = list(prompt[-window:])  # what a refill may need: the last window of the sequence
    step = torch.tensor([tokens], dtype=torch.long, device=device)
    for produced in range(1, max_new_tokens + 1):
        with mode():  # the logits are inference tensors there: _pick's in-place masking is done inside too
            logits = model(step, cache=cache)[:, -1]
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


def _inference_mode(model: GPT) -> Callable[[], contextlib.AbstractContextManager[object]]:
    """What each forward of a generation runs in: inference_mode (which skips the autograd
    bookkeeping of every op: ~10% of a small model's token on CPU) unless the model or one of its
    modules has forward hooks: FSDP2 gathers a sharded model's parameters in them and fails on
    inference tensors (an eval task during parallel=fsdp training); no_grad (stream_tokens's) is
    enough there."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return contextlib.nullcontext
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return contextlib.nullcontext
    return torch.inference_mode


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None,
          vocab_limit: int | None, guard: TokenGuard | None = None) -> int:
    """The next token from the logits (1, vocab): the likeliest at temperature <= 0, else sampled;
    never an id at or past `vocab_limit` or one `guard` bans."""
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
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
