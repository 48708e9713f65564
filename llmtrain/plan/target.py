"""What a plan is for: how many devices, how much memory each, which kind (and so which
precision), and the model's shape with the vocabulary the data gives it.

The config goes through the same facts as `llmtrain check` (preflight/facts.py: the data's
vocabulary, the model's shape, on a CPU the process's own footprint and the data's pages), so a
one-device plan is the check's memory estimate.

The device type is the config's `device`; with device=auto, this machine's (cuda, mps, else cpu),
except that a memory size given on a machine without CUDA plans for CUDA devices elsewhere (a
laptop sizing a GPU run); device=cpu plans CPU processes all the same."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llmtrain.config.schema import Config, Precision
from llmtrain.core.errors import UserError
from llmtrain.distributed.layout import resolve_device
from llmtrain.engine.precision import resolve_precision
from llmtrain.preflight.estimate import ModelShape, available_memory, format_bytes
from llmtrain.preflight.facts import MEMORY_WARN_FRACTION, gather_facts


@dataclass(frozen=True)
class Target:
    """The devices a plan is for, and the model as the data sizes it."""

    cfg: Config
    devices: int
    device_memory: float  # bytes each device offers
    memory_source: str  # where device_memory comes from: "given", "free on NVIDIA H200 (141 GiB total)", ...
    device_type: str  # cuda, cpu, mps
    precision: Precision  # `auto` resolved for the device type
    precision_note: str  # how it was resolved, when it was: "precision=auto on cuda"
    vocab_size: int
    shape: ModelShape
    runtime_bytes: float = 0.0  # CPU only: the process itself (Python, torch), as the check counts it
    data_bytes: float = 0.0  # CPU only: the memory-mapped token file's pages

    @property
    def budget(self) -> float:
        """The peak that counts as fitting: MEMORY_WARN_FRACTION of a device's memory (the rest is
        the margin for fragmentation and spikes, as the check's memory row keeps)."""
        return self.device_memory * MEMORY_WARN_FRACTION

    def describe(self) -> str:
        """'8 cuda devices of 80.0 GiB each (given), bf16 (precision=auto on cuda)'."""
        plural = "s" if self.devices != 1 else ""
        each = " each" if self.devices != 1 else ""
        note = f" ({self.precision_note})" if self.precision_note else ""
        return (f"{self.devices} {self.device_type} device{plural} of {format_bytes(self.device_memory)}{each} "
                f"({self.memory_source}), {self.precision.value}{note}")


def resolve_target(cfg: Config, devices: int | None = None, device_memory: float | None = None) -> Target:
    """The target of a plan for `cfg`: `devices` (default: this machine's CUDA devices, else 1) of
    `device_memory` bytes (default: this machine's free memory, a CPU's shared by the processes)."""
    here = resolve_device("auto")
    if cfg.device != "auto":
        device_type = torch.device(cfg.device).type
    elif device_memory is not None and here.type != "cuda":
        device_type = "cuda"  # sizing GPUs from a machine without one
    else:
        device_type = here.type
    local = device_type in (here.type, "cpu")  # devices this machine has (every machine has a CPU)
    if devices is None:
        devices = torch.cuda.device_count() if device_type == "cuda" and local else 1
    # The data's vocabulary, the model's shape and, on a CPU, the process and the data pages: as the
    # check gathers them. On another machine's devices (cuda from here), the facts are gathered on
    # this CPU and its host-only figures left out.
    facts = gather_facts(cfg if local else dataclasses.replace(cfg, device="cpu"), measure_compute=False)
    runtime, data = (facts.memory.runtime, facts.memory.data) if device_type == "cpu" else (0.0, 0.0)
    if device_memory is not None:
        source = "given"
    elif not local:
        raise UserError(f"this machine has no {device_type} device to read the memory of; give the target's with "
                        "--device-memory, e.g. --device-memory 80GB.")
    elif device_type == "cpu":
        # the check's budget (the free memory plus what this process holds already), shared by the processes
        device_memory = facts.memory_budget / devices
        source = facts.memory_source + (f", shared by {devices} processes" if devices > 1 else "")
    else:
        device_memory, source = available_memory(facts.device)
    if cfg.precision.name is not Precision.auto:
        precision, note = cfg.precision.name, ""
    elif device_type == "cuda" and not torch.cuda.is_available():
        # bf16 on the GPUs of the last generations (Ampere on); fp16 where there is none takes as much memory
        precision, note = Precision.bf16, "precision=auto on cuda, assumed bf16"
    else:
        precision = resolve_precision(Precision.auto, torch.device(device_type))
        note = f"precision=auto on {device_type}"
    return Target(cfg=cfg, devices=devices, device_memory=device_memory, memory_source=source,
                  device_type=device_type, precision=precision, precision_note=note, vocab_size=facts.vocab_size,
                  shape=facts.shape, runtime_bytes=runtime, data_bytes=data)
