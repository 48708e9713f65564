"""What a run is made of: the objects `setup.build_run` builds and `loop.fit` trains with."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmtrain.checkpoint.policy import Checkpointer
from llmtrain.config.derived import SeqLenStage
from llmtrain.config.schema import Config, PrecisionConfig
from llmtrain.core.faults import Faults
from llmtrain.data import EpochSampler, InstructionSampler, RandomWindowSampler
from llmtrain.data.cache import PreparedData
from llmtrain.distributed.layout import Layout
from llmtrain.engine.state import TrainResult, TrainState
from llmtrain.engine.step import Batch
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.metrics.writer import MetricsWriter, NullMetricsWriter
from llmtrain.monitor.watch import Monitor, NullMonitor
from llmtrain.preflight.check import CheckReport
from llmtrain.training.evaluator import Evaluator
from llmtrain.training.progress import Progress
from llmtrain.training.stages import SeqLenStages

TrainSampler = RandomWindowSampler | EpochSampler | InstructionSampler


@dataclass
class Runtime:
    """Where and how this process computes."""

    device: torch.device
    seed: int  # the run's seed: cfg.seed, or one drawn (by rank 0, for all)
    threads: int
    precision: PrecisionConfig  # with the name resolved (auto -> what the device does)
    threads_reason: str = ""  # threads=auto: what was measured ("auto: 2.0 of 2 cores free"); "" when set
    matmul_flops: float | None = None  # this device's matmul rate, measured with the run's threads (the estimate, MFU)


@dataclass
class Model:
    """The model three ways: `model` the plain module (state dicts, evaluation, the monitor's
    hooks), `train_model` what the forward/backward goes through (DDP, or the model itself),
    and whether FSDP2 shards its parameters."""

    model: torch.nn.Module
    train_model: torch.nn.Module
    sharded: bool


@dataclass
class Optimization:
    """The optimizer, and how checkpoints read and write the full state: plainly, gathered from
    the ranks' shards, or (sharded files) each rank writing and reading its own shards."""

    optimizer: torch.optim.Optimizer
    model_state: Any
    optimizer_state: Any
    sharded_files: bool


@dataclass
class Run:
    """Everything the step loop needs, built by `build_run`."""

    cfg: Config
    layout: Layout
    run_dir: Path
    sink: Dashboard
    warn: Callable[[str], None]  # a warning on the console
    runtime: Runtime
    data: PreparedData
    vocab_size: int
    check: CheckReport
    config_dict: dict
    resume_from: Path | None  # the checkpoint resumed from
    model: Model
    optim: Optimization
    autocast: Callable[[], ContextManager]
    scaler: torch.amp.GradScaler | None
    params: list[torch.nn.Parameter]  # the trainable ones: clipping
    train_batches: TrainSampler
    val_batches: list[Batch]
    state: TrainState  # rebound by the loop after a rollback
    total_steps: int  # the run's length: checkpoints, progress, the health monitor
    schedule_steps: int  # the LR schedule's length (`schedule_steps`): shorter or longer than the run
    micro_total: int  # micro-batches of the whole run, per process
    accum: int
    seq_len: int
    stage_plan: list[SeqLenStage]
    tokens_per_step: int
    peak_lr: float
    faults: Faults
    eval_tasks: list[Any]  # eval.tasks, encoded (llmtrain.evaluation.tasks.Task): run at every evaluation
    # The loop's parts, built after the banner (the sinks open files, and W&B prints):
    metrics: MetricsWriter | NullMetricsWriter = field(init=False)
    flops_per_token: float = field(init=False)
    result: TrainResult = field(init=False)
    watch: Monitor | NullMonitor = field(init=False)
    saver: Checkpointer = field(init=False)
    evaluator: Evaluator = field(init=False)
    stages: SeqLenStages = field(init=False)
    progress: Progress = field(init=False)

    @property
    def device(self) -> torch.device:
        return self.runtime.device
