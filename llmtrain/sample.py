"""Text generation from a finished run: `llmtrain sample <run dir>`."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from llmtrain.config import config_from_dict
from llmtrain.data.tokenizers import Tokenizer, load_tokenizer
from llmtrain.errors import ConfigError, UserError
from llmtrain.model import GPT


def load_run(run_dir: Path, device: str = "cpu") -> tuple[GPT, Tokenizer]:
    """The trained model (in eval mode) and its tokenizer from a run directory."""
    run_dir = Path(run_dir)
    needed = [run_dir / name for name in ("config.yaml", "tokenizer.json", "model.pt")]
    missing = [p.name for p in needed if not p.is_file()]
    if missing:
        raise UserError(
            f"'{run_dir}' is not a finished llmtrain run directory: {', '.join(missing)} missing. "
            "Give the directory that `llmtrain train` printed in its banner (e.g. outputs/<date>/<time>)."
        )
    try:
        cfg = config_from_dict(yaml.safe_load(needed[0].read_text()))
    except ConfigError as err:
        raise UserError(f"'{needed[0]}' is not a valid llmtrain config: {err}") from None
    tokenizer = load_tokenizer(needed[1])
    # weights_only: a weights file must not be able to run code when loaded.
    state = torch.load(needed[2], map_location=device, weights_only=True)
    vocab_size = state["wte.weight"].shape[0]
    model = GPT(cfg.model, vocab_size)
    model.load_state_dict(state)
    return model.to(device).eval(), tokenizer


@torch.no_grad()
def generate(
    model: GPT,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Autoregressive sampling; the same generator seed gives the same tokens."""
    device = next(model.parameters()).device
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        logits = model(idx[:, -model.cfg.block_size :])[:, -1, :].float()
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
    return idx[0, len(prompt) :].tolist()


def sample_text(
    run_dir: Path,
    prompt: str = "\n",
    max_new_tokens: int = 400,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
) -> str:
    model, tokenizer = load_run(run_dir)
    try:
        prompt_ids = tokenizer.encode(prompt) if prompt else [0]
    except ValueError as err:
        raise UserError(f"The prompt {prompt!r} cannot be encoded: {err}.") from None
    generator = torch.Generator().manual_seed(seed)
    return tokenizer.decode(generate(model, prompt_ids, max_new_tokens, temperature, top_k, generator))
