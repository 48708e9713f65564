"""The train loop. Read it top to bottom:

    set up (seed, threads, device, data, model, optimizer, precision) -> banner
    for each optimizer step:
        gather the accumulation window's micro-batches and count their real tokens
        forward -> masked loss SUM / tokens in the window -> backward   (per micro-batch)
        unscale (fp16) -> clip -> optimizer step -> zero grad            (LR set from the schedule)
        every log_interval: the only host sync -> metrics.jsonl and the console
        every eval_interval: eval mode on fixed validation batches -> back to train mode
    save the final weights, tokenizer and summary into the run dir

Dividing each micro-batch's loss sum by the token count of the whole window makes the accumulated
gradient exactly the gradient of one big batch, whatever the micro-batch size, and lets a final
window with fewer micro-batches still step with the right scale.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml

from llmtrain.config import (
    Config,
    ConfigError,
    accumulation_steps,
    config_to_dict,
    resolved_warmup_steps,
    seq_len_of,
    total_micro_batches,
    total_steps,
    validate,
)
from llmtrain.data import RandomWindowSampler, prepare_data
from llmtrain.data.tokenizers import save_tokenizer
from llmtrain.model import GPT, flops_per_token, param_count
from llmtrain.optim import build_optimizer, clip_gradients
from llmtrain.parallel import default_threads, resolve_device
from llmtrain.precision import autocast_factory, build_grad_scaler
from llmtrain.schedule import lr_at
from llmtrain.sinks import ConsoleSink, JsonlSink

IGNORE_INDEX = -100
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    tokens: int
    train_losses: dict[int, float] = field(default_factory=dict)  # step -> mean loss of that step
    val_losses: dict[int, float] = field(default_factory=dict)
    unigram_entropy: float = math.nan

    @property
    def final_val_loss(self) -> float:
        return self.val_losses[max(self.val_losses)] if self.val_losses else math.nan


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over real tokens; targets equal to IGNORE_INDEX count for nothing."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def count_tokens(batches: Iterable[Batch]) -> int:
    """Real (non-ignored) target tokens in a window, counted on the host before the batches move."""
    return int(sum(int((y != IGNORE_INDEX).sum()) for _, y in batches))


def accumulate_gradients(
    model: torch.nn.Module,
    batches: list[Batch],
    device: torch.device,
    autocast: Callable[[], ContextManager],
    scaler: torch.amp.GradScaler | None = None,
) -> torch.Tensor:
    """Forward/backward over one accumulation window; returns the window's mean loss (a tensor)."""
    n_tokens = max(1, count_tokens(batches))
    window_loss = torch.zeros((), device=device)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast():
            loss = loss_sum(model(x), y) / n_tokens
        (scaler.scale(loss) if scaler is not None else loss).backward()
        window_loss += loss.detach()
    return window_loss


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[Batch], device: torch.device, autocast: Callable[[], ContextManager]) -> float:
    """Mean loss per real token over fixed batches, in eval mode (dropout off); restores train mode."""
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float32 if device.type == "mps" else torch.float64)
    for x, y in batches:
        with autocast():
            total += loss_sum(model(x.to(device)), y.to(device)).to(total.dtype)
    model.train()
    return total.item() / max(1, count_tokens(batches))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too


def train(cfg: Config, console: ConsoleSink | None = None) -> TrainResult:
    # ---- set-up: everything that can fail on user input fails here, before any compute --------
    validate(cfg)
    if cfg.out_dir is None:
        raise ConfigError("'out_dir' is not set; give a run directory, e.g. out_dir=runs/first.")
    run_dir = Path(cfg.out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    threads = cfg.threads or default_threads()
    torch.set_num_threads(threads)
    device = resolve_device(cfg.device)

    steps_total = total_steps(cfg)
    micro_total = total_micro_batches(cfg)
    accum = accumulation_steps(cfg)
    seq_len = seq_len_of(cfg)
    sink = console or ConsoleSink(steps_total)

    data = prepare_data(cfg.data, log=lambda msg: sink.print(f"[dim]{msg}[/]"))
    for split in ("train", "val") if cfg.eval_interval else ("train",):
        if data.meta[f"{split}_tokens"] < seq_len + 1:
            raise ConfigError(
                f"The {split} split has {data.meta[f'{split}_tokens']} tokens, fewer than one sequence of "
                f"data.seq_len={seq_len} (+1 target); use more text (or a larger data.max_bytes), "
                "a shorter data.seq_len, or a larger data.val_fraction."
            )
    vocab_size = cfg.model.vocab_size or data.vocab_size
    if vocab_size < data.vocab_size:
        raise ConfigError(
            f"'model.vocab_size' ({vocab_size}) is smaller than the data's vocabulary ({data.vocab_size} tokens, "
            f"{cfg.data.tokenizer.value} tokenizer); use model.vocab_size>={data.vocab_size} or model.vocab_size=null."
        )
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    save_tokenizer(data.tokenizer(), run_dir / "tokenizer.json")

    model = GPT(cfg.model, vocab_size).to(device)
    model.train()
    optimizer = build_optimizer(model, cfg.optim, device.type)
    autocast = autocast_factory(cfg.precision, device.type)
    scaler = build_grad_scaler(cfg.precision, device.type)
    params = [p for p in model.parameters() if p.requires_grad]

    # The sampler owns its RNG, so the data order is independent of init and dropout.
    data_seed = cfg.data.seed if cfg.data.seed is not None else cfg.seed
    train_batches = RandomWindowSampler(data.tokens("train"), cfg.micro_batch_size, seq_len, data_seed)
    val_batches = []
    if cfg.eval_interval:
        val_sampler = RandomWindowSampler(data.tokens("val"), cfg.micro_batch_size, seq_len, data_seed + 1)
        val_batches = [tuple(t.to(device) for t in val_sampler.next_batch()) for _ in range(cfg.eval_batches)]

    tokens_per_step = cfg.global_batch_size * seq_len
    sink.banner(
        f"llmtrain: {cfg.model.name} on {cfg.data.source.value} -> {run_dir}",
        [
            ("parameters", f"{param_count(model):,} ({param_count(model, exclude_positions=True):,} without positions)"),
            ("batch", f"{cfg.global_batch_size} sequences x {seq_len} tokens = {tokens_per_step:,} tokens/step"),
            ("accumulation", f"{accum} micro-batch{'es' if accum > 1 else ''} of {cfg.micro_batch_size} (world size 1)"),
            ("steps", f"{steps_total:,} (warmup {resolved_warmup_steps(cfg.schedule, steps_total)}, {cfg.schedule.name.value}), "
                      f"{micro_total * cfg.micro_batch_size * seq_len:,} tokens"),
            ("optimizer", f"{cfg.optim.name.value} lr {cfg.optim.lr:g}, {type(optimizer).__name__}"
                          f"{' (fused)' if optimizer.defaults.get('fused') else ''}"),
            ("device", f"{device}, {cfg.precision.name.value}, {threads} threads"),
            ("data", f"{data.meta['train_tokens']:,} train / {data.meta['val_tokens']:,} val tokens, "
                     f"vocab {data.vocab_size}, {cfg.data.tokenizer.value} tokens"),
            ("baseline", f"unigram entropy {data.unigram_entropy:.4f} nats/token: the loss to beat"),
        ],
    )

    # ---- the loop ------------------------------------------------------------------------------
    metrics = JsonlSink(run_dir / "metrics.jsonl")
    # Appending (never truncating) keeps an earlier run's records; this marks where this one starts.
    metrics.write({"kind": "start", "time": time.time(), "steps": steps_total, "tokens_per_step": tokens_per_step})
    result = TrainResult(run_dir=run_dir, steps=0, tokens=0, unigram_entropy=data.unigram_entropy)
    flops_token = flops_per_token(model, seq_len)
    sink.start()
    start = last_log_time = time.perf_counter()
    last_log_tokens = 0
    try:
        for step in range(steps_total):
            window = [train_batches.next_batch() for _ in range(min(accum, micro_total - step * accum))]
            lr = lr_at(step, cfg.optim.lr, steps_total, cfg.schedule)
            for group in optimizer.param_groups:
                group["lr"] = lr

            loss = accumulate_gradients(model, window, device, autocast, scaler)
            if scaler is not None:
                scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            grad_norm = clip_gradients(params, cfg.optim)
            if scaler is not None:
                scaler.step(optimizer)  # skips the step if the gradients overflowed
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            result.steps = step + 1
            result.tokens += sum(y.numel() for _, y in window)
            sink.advance(result.steps)
            last_step = result.steps == steps_total
            if result.steps % cfg.log_interval == 0 or last_step:
                # The one host sync of the step: .item() waits for the device to finish.
                now = time.perf_counter()
                record = {
                    "kind": "train",
                    "step": result.steps,
                    "tokens": result.tokens,
                    "loss": loss.item(),
                    "lr": lr,
                    "grad_norm": grad_norm.item(),
                    "tokens_per_s": (result.tokens - last_log_tokens) / max(now - last_log_time, 1e-9),
                    "elapsed_s": now - start,
                }
                record["flops_per_s"] = record["tokens_per_s"] * flops_token
                if scaler is not None:
                    record["loss_scale"] = scaler.get_scale()
                last_log_time, last_log_tokens = now, result.tokens
                result.train_losses[result.steps] = record["loss"]
                metrics.write(record)
                sink.log_train(record)
            if cfg.eval_interval and (result.steps % cfg.eval_interval == 0 or last_step):
                val_loss = evaluate(model, val_batches, device, autocast)
                record = {"kind": "eval", "step": result.steps, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
                result.val_losses[result.steps] = val_loss
                metrics.write(record)
                sink.log_eval(record)
                # tokens/s measures training, not evaluation: restart its clock and count here.
                last_log_time, last_log_tokens = time.perf_counter(), result.tokens
    finally:
        sink.stop()
        metrics.close()

    # ---- the end: weights for `sample`; full checkpoints are checkpoint.py's job ----------------
    save_weights(model, run_dir / "model.pt")
    elapsed = time.perf_counter() - start
    summary = f"[bold]done[/]: {result.steps} steps, {result.tokens:,} tokens in {elapsed:.1f}s ({result.tokens / max(elapsed, 1e-9):,.0f} tok/s)"
    if result.val_losses and data.unigram_entropy > 0:
        below = 1 - result.final_val_loss / data.unigram_entropy
        summary += (
            f"; final val loss {result.final_val_loss:.4f} is {abs(below):.0%} {'below' if below >= 0 else 'ABOVE'} "
            f"the unigram entropy {data.unigram_entropy:.4f}"
        )
    sink.print(f"{summary}. Weights: {run_dir / 'model.pt'}")
    return result


def save_weights(model: torch.nn.Module, path: Path) -> None:
    """Write the unwrapped model's state dict atomically (temp file, fsync, rename)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            torch.save(model.state_dict(), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
