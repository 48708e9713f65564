"""The parts of a run built before its banner, each in one phase and none changed after it: the
context (config, processes, run dir, runtime, data, check, console), the train module and the
batches (run.py puts them together with the plan and the loop's parts)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from llmtrain.config.schema import Config, PrecisionConfig
from llmtrain.core.faults import Faults
from llmtrain.data.cache import PreparedData
from llmtrain.distributed.layout import Layout
from llmtrain.engine.precision import NumericPrecision
from llmtrain.engine.step import Batch
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.preflight.check import CheckReport
from llmtrain.training.compile_trial import CompileChoice


@dataclass(frozen=True)
class Runtime:
    """Where and how this process computes."""

    device: torch.device
    seed: int  # the run's seed: cfg.seed, or one drawn (by rank 0, for all); a resumed run keeps its own
    threads: int
    precision: PrecisionConfig  # with the name resolved (auto -> what the device does)
    threads_reason: str = ""  # threads=auto: what was measured ("auto: 2.0 of 2 cores free"); "" when set
    matmul_flops: float | None = None  # this device's matmul rate, measured with the run's threads (the estimate, MFU)


@dataclass(frozen=True)
class Context:
    """Where the run is and what it starts from: its config, processes, run dir, runtime, data,
    pre-flight check, console and the checkpoint it resumes (everything that can be refused on user
    input is refused before any of it is put together)."""

    cfg: Config
    config_dict: dict  # the resolved config, as config.yaml and every checkpoint hold it
    layout: Layout
    run_dir: Path
    runtime: Runtime
    data: PreparedData
    check: CheckReport  # the pre-flight check (no FAIL, or the run was refused)
    resume_from: Path | None  # the checkpoint resumed from
    dashboard: Dashboard
    warn: Callable[[str], None]  # a warning on the console
    faults: Faults  # the tests' injections (none in a real run)
    # A LoRA run on a folder's weights: the folder's identity (hf/lora_base.py), which every
    # checkpoint records beside its adapters; None for any other run.
    lora_base: dict | None = None
    # compile on, off, or auto's choice before step 1 (compile_trial.py): the banner says it, the loop
    # runs auto's trial; None for a Context built without one (eager, no trial).
    compiling: CompileChoice | None = None

    @property
    def device(self) -> torch.device:
        return self.runtime.device


@dataclass(frozen=True)
class Model:
    """The model three ways: `model` the plain module (state dicts, evaluation, the monitor's
    hooks), `train_model` what the forward/backward goes through (DDP, or the model itself),
    whether its parameters are split over the ranks (DTensors: FSDP2, tensor parallel), and
    whether tensor parallel split its layers."""

    model: torch.nn.Module
    train_model: torch.nn.Module
    sharded: bool
    tensor_parallel: bool = False
    mesh: Any = None  # the run's DeviceMesh (None: one process)


@dataclass(frozen=True)
class TrainModule:
    """What a step computes with: the model (plain, and what the forward goes through), the
    optimizer, the views checkpoints read and write their state through (plainly, gathered from the
    ranks' shards, or, with sharded files, each rank its own shards), the trainable parameters
    (clipping) and the precision."""

    model: torch.nn.Module
    train_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    model_state: Any  # anything with state_dict()/load_state_dict(): the model, or its sharded view
    optimizer_state: Any  # the optimizer, or its sharded or consolidated (ZeRO-1) view
    sharded_files: bool
    params: list[torch.nn.Parameter]
    precision: NumericPrecision
    # Pipeline parallel (llmtrain/distributed/pipeline.Pipeline): this process's stages, which the
    # window's forward/backward, clipping and evaluation go through; None otherwise.
    pipeline: Any = None


class Sampler(Protocol):
    """The train batches, as the loop, the stages and checkpoints see the three samplers of
    llmtrain/data (RandomWindowSampler, EpochSampler, InstructionSampler)."""

    batch_size: int
    seq_len: int

    def next_batch(self) -> Batch: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class Batches:
    """The train sampler (its own RNG: the data order is independent of init and dropout) and the
    fixed validation batches every evaluation uses, on the device."""

    train: Sampler
    val: list[Batch]
