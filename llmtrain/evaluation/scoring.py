"""Log-likelihoods of continuations under a trained model: the one computation every evaluation
task reduces to (held-out perplexity, multiple choice, the lm-evaluation-harness adapter).

A request is (context ids, continuation ids). The model reads context + continuation (cut from the
left to its window when longer) and the continuation's tokens are scored by the positions that
predict them. `Scorer.loglikelihood` batches requests longest first (little padding), pads on the
right (a causal model's real positions never see the padding, so a score does not depend on its
batch), applies the LM head only at scored positions (for multiple choice most positions are
context), and returns the results in the order of the requests.

Perplexity over a document is the same computation: `rolling_requests` cuts the document into
windows whose continuations tile it exactly once (the lm-evaluation-harness's
loglikelihood_rolling), each window with as much preceding text as context as fits.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from llmtrain.data.tokenizers import Tokenizer
from llmtrain.model import GPT

Request = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)
_Prepared = tuple[list[int], int, bool]  # (the tokens the window holds, continuation length, context cut)

# Requests a task hands the Scorer per call, in batches: enough that short requests batch together
# (little padding), few enough that a long file's requests are never all prepared in memory at once.
REQUESTS_PER_CALL_PER_BATCH = 64
# Logits materialized at once while scoring, in elements: bounds memory for large vocabularies
# (GPT-2's 50,257 x 2,048 positions x 4 bytes = 412 MB) without slowing small ones.
LOGIT_CHUNK_ELEMENTS = 1 << 27


@dataclass(frozen=True)
class Score:
    logprob: float  # summed log-probability of the continuation's tokens (nats)
    greedy: bool | None  # every continuation token is the model's most likely next token (None: not asked)
    tokens: int  # continuation tokens scored
    truncated: bool  # the context was cut from the left to fit the model's window


class Scorer:
    """Scores requests with `model` (a GPT, or a wrapper whose forward gives logits) in eval mode
    and without gradients; the model's train/eval mode is restored afterwards.

    `window` is the longest input the model reads: its training context. `autocast` is the
    precision context (a training run's own; nullcontext for fp32)."""

    def __init__(self, model: torch.nn.Module, window: int, batch_size: int = 8,
                 autocast: Callable[[], AbstractContextManager] = nullcontext) -> None:
        if window < 1 or batch_size < 1:
            raise ValueError(f"window ({window}) and batch_size ({batch_size}) must be >= 1")
        self.model, self.window, self.batch_size, self.autocast = model, window, batch_size, autocast
        self.device = next(model.parameters()).device
        # A plain GPT gives its hidden states, so the head runs only where a token is scored; a
        # wrapped one (FSDP's per-class subclass gathers its weights in forward only) gives logits.
        self._hidden = type(model) is GPT

    def loglikelihood(self, requests: Sequence[Request], progress: Callable[[int], None] | None = None,
                      greedy: bool = True) -> list[Score]:
        """One Score per request, in order. `progress(n)` is called after every batch with the
        number of requests it finished; `greedy=False` skips the greedy check (an argmax over the
        vocabulary at every scored position: ~5% of a small model's evaluation, and perplexity
        does not need it). A continuation must be non-empty and fit the window; the
        context must be non-empty (give the end-of-text id for "no context": it is what precedes
        every document in training)."""
        prepared = [self._prepare(i, context, continuation) for i, (context, continuation) in enumerate(requests)]
        order = sorted(range(len(prepared)), key=lambda i: -len(prepared[i][0]))
        scores: list[Score | None] = [None] * len(prepared)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(order), self.batch_size):
                    batch = order[start:start + self.batch_size]
                    for i, score in zip(batch, self._score_batch([prepared[i] for i in batch], greedy)):
                        scores[i] = score
                    if progress is not None:
                        progress(len(batch))
        finally:
            self.model.train(was_training)
        return scores  # type: ignore[return-value]  # every slot was filled

    def _prepare(self, index: int, context: Sequence[int], continuation: Sequence[int]) -> _Prepared:
        context, continuation = _ids(context), _ids(continuation)
        if not continuation:
            raise ValueError(f"request {index}: the continuation is empty (nothing to score)")
        if not context:
            raise ValueError(f"request {index}: the context is empty; give the end-of-text id as the context")
        if len(continuation) > self.window:
            raise ValueError(f"request {index}: the continuation has {len(continuation)} tokens, more than the "
                             f"model's window of {self.window}")
        whole = context + continuation
        # The model reads all but the last token; the last n are the targets.
        return whole[-(self.window + 1):], len(continuation), len(whole) - 1 > self.window

    def _score_batch(self, batch: list[_Prepared], greedy: bool) -> list[Score]:
        longest = max(len(tokens) - 1 for tokens, _, _ in batch)
        x = torch.zeros((len(batch), longest), dtype=torch.long)  # right padding: no real position sees it
        rows, positions, targets = [], [], []  # each scored position and the token it predicts
        for row, (tokens, n, _) in enumerate(batch):
            length = len(tokens) - 1
            x[row, :length] = torch.tensor(tokens[:-1], dtype=torch.long)
            rows += [row] * n
            positions += range(length - n, length)
            targets += tokens[-n:]
        x = x.to(self.device)
        with self.autocast():
            out = self.model.hidden_states(x) if self._hidden else self.model(x)
        picked = out[torch.tensor(rows, device=self.device), torch.tensor(positions, device=self.device)]
        logprobs, is_argmax = self._token_logprobs(picked, torch.tensor(targets, device=self.device), greedy)
        scores, at = [], 0
        for _, n, truncated in batch:
            top = bool(is_argmax[at:at + n].all()) if is_argmax is not None else None
            scores.append(Score(float(logprobs[at:at + n].sum()), top, n, truncated))
            at += n
        return scores

    def _token_logprobs(self, picked: torch.Tensor, targets: torch.Tensor,
                        greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log p(target) and (if `greedy`) whether it is the argmax, per scored position (float64
        on the host, for the sums)."""
        vocab = self.model.lm_head.out_features if self._hidden else picked.shape[-1]
        chunk = max(1, LOGIT_CHUNK_ELEMENTS // vocab)
        logprobs, argmax = [], []
        for start in range(0, picked.shape[0], chunk):
            part = picked[start:start + chunk]
            if self._hidden:
                with self.autocast():
                    part = self.model.lm_head(part)
            logits = part.float()
            target = targets[start:start + chunk]
            logprobs.append((-F.cross_entropy(logits, target, reduction="none")).cpu().double())
            if greedy:
                argmax.append((logits.argmax(dim=-1) == target).cpu())
        return torch.cat(logprobs), torch.cat(argmax) if greedy else None


def _ids(tokens: Sequence[int]) -> list[int]:
    """Python ints of a list or a NumPy array (whose own items would be NumPy scalars)."""
    return tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)


def rolling_requests(
    tokens: Sequence[int], prefix_id: int, window: int, stride: int | None = None
) -> Iterator[Request]:
    """Requests whose continuations cover `tokens` exactly once, in order: the first predicts
    tokens[0] from `prefix_id` (end-of-text: what precedes a document in training). Each window
    scores up to `stride` new tokens (default: the window, i.e. non-overlapping windows) with the
    tokens before them as context, cut to the window by the scorer; a smaller stride gives every
    scored token more context at more forward passes."""
    stride = window if stride is None else stride
    if not 1 <= stride <= window:
        raise ValueError(f"stride {stride} must be between 1 and the window ({window})")
    if not len(tokens):  # a list or a NumPy array: sliced, never copied whole
        return
    yield [prefix_id], tokens[:window]
    for start in range(window, len(tokens), stride):
        yield tokens[max(0, start - window):start], tokens[start:start + stride]


def encode_pair(
    tokenizer: Tokenizer, context: str, continuation: str, empty_context_id: int
) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as the lm-evaluation-harness makes them: trailing whitespace
    of the context moves to the continuation, the whole text is encoded at once and the continuation
    is what follows the context's own encoding (so a merge across the boundary is not split in
    an unnatural place). An empty context becomes `empty_context_id` (end-of-text)."""
    stripped = len(context) - len(context.rstrip())
    if stripped:
        context, continuation = context[:-stripped], context[-stripped:] + continuation
    if not context:
        return [empty_context_id], tokenizer.encode(continuation)
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    # a context the tokenizer drops entirely (characters it does not know) is no context at all
    return context_ids or [empty_context_id], whole[len(context_ids):]


@contextmanager
def random_states_kept() -> Iterator[None]:
    """Python's, NumPy's and torch's global generators (every initialized CUDA device's too) as
    they were before. Evaluation during training must not move training's random streams (dropout,
    the init of what is built next), and the harness's simple_evaluate seeds all of them."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
