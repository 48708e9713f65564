"""The run's plan: every number derived from the config (and from what the data decides, its
vocabulary), computed once, in `build_plan`, before anything is built from them. Each field is
named after the function that computes it (llmtrain/config/derived.py, or the model's tensors for
`flops_per_token`); `seq_len` is derived.seq_len_of and `tokens_per_step` the global batch's
sequences times it."""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.config.derived import (
    SeqLenStage,
    accumulation_steps,
    effective_lr,
    model_vocab_size,
    schedule_steps,
    seq_len_of,
    seq_len_stages,
    tokens_per_step,
    total_micro_batches,
    total_steps,
)
from llmtrain.config.schema import Config
from llmtrain.model_tensors import model_tensors


@dataclass(frozen=True)
class Plan:
    total_steps: int  # the run's length: checkpoints, progress, the health monitor
    schedule_steps: int  # the LR schedule's length: shorter or longer than the run
    total_micro_batches: int  # micro-batches of the whole run, per process
    accumulation_steps: int  # micro-batches per optimizer step, per process
    seq_len: int  # the final (or only) sequence length
    seq_len_stages: tuple[SeqLenStage, ...]  # one without data.seq_len_schedule
    tokens_per_step: int
    effective_lr: float  # the peak LR, batch-scaled as schedule.lr_scaling says
    model_vocab_size: int  # the data's vocabulary, padded as the model asks
    flops_per_token: float  # of a training step (forward and backward) at `seq_len`

    @property
    def longest_seq_len(self) -> int:
        """The longest sequence the run trains on (the evaluation tasks' window)."""
        return max(stage.seq_len for stage in self.seq_len_stages)


def build_plan(cfg: Config, data_vocab_size: int) -> Plan:
    """The plan of a validated config whose data has `data_vocab_size` token ids."""
    seq_len, vocab_size = seq_len_of(cfg), model_vocab_size(cfg, data_vocab_size)
    return Plan(total_steps=total_steps(cfg), schedule_steps=schedule_steps(cfg),
                total_micro_batches=total_micro_batches(cfg), accumulation_steps=accumulation_steps(cfg),
                seq_len=seq_len, seq_len_stages=tuple(seq_len_stages(cfg)),
                tokens_per_step=tokens_per_step(cfg), effective_lr=effective_lr(cfg),
                model_vocab_size=vocab_size,
                flops_per_token=model_tensors(cfg.model, vocab_size).flops_per_token(seq_len))
