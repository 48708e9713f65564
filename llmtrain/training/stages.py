"""Sequence-length stages (data.seq_len_schedule): which stage a step is in, and the switch to it.

A run without a schedule has one stage and nothing here does anything. With several, the sampler
is reshaped to the stage of every step (also on resume, silently) and the first step of each stage
writes a `seq_len` record; every stage but the first (which the banner shows) is announced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmtrain.config.derived import SeqLenStage, stage_at
from llmtrain.core.files import Kind
from llmtrain.metrics.dashboard import Dashboard


class SeqLenStages:
    def __init__(self, *, stages: Sequence[SeqLenStage], sampler: Any, dashboard: Dashboard, metrics: Any,
                 processes_per_step: int) -> None:
        # sampler: the train sampler, reshaped (RandomWindowSampler.reshape: validation allows a
        # schedule with random windows only). processes_per_step: accumulation steps x world size,
        # the micro-batches of one optimizer step.
        self.stages, self.sampler, self.dashboard, self.metrics = list(stages), sampler, dashboard, metrics
        self.processes_per_step = processes_per_step
        self.current = stages[0]

    @property
    def staged(self) -> bool:
        """More than one stage (only then do train records carry their `seq_len`)."""
        return len(self.stages) > 1

    def begin_step(self, step: int) -> SeqLenStage:
        """The stage of `step` (0-based: the steps taken before it), with the sampler shaped for it."""
        self.current = stage = stage_at(self.stages, step)
        if not self.staged:
            return stage
        if (stage.micro_batch_size, stage.seq_len) != (self.sampler.batch_size, self.sampler.seq_len):
            self.sampler.reshape(stage.micro_batch_size, stage.seq_len)  # also on resume, silently
        if step == stage.start_step:
            stage_tokens = stage.micro_batch_size * stage.seq_len * self.processes_per_step
            if step:  # the first stage is in the banner
                self.dashboard.print(f"sequence length {stage.seq_len}, micro-batch {stage.micro_batch_size} from "
                                f"step {step + 1} on ({stage_tokens:,} tokens/step)")
            self.metrics.write({"kind": Kind.SEQ_LEN, "step": step, "seq_len": stage.seq_len,
                                "micro_batch_size": stage.micro_batch_size, "tokens_per_step": stage_tokens})
        return stage
