"""What a checkpoint is on disk: the folder names, the files, the format version, and the
`Checkpoint` a verified one is read back as (checkpoint/read.py reads it, write.py writes it).

Layout of a run dir:

    checkpoints/
      step_00000250/          one checkpoint, taken at an optimizer-step boundary
        model.pt              the unwrapped model's state_dict
        optimizer.pt          optimizer (+ fp16 loss-scaler) state
        rng.pt                torch CPU (and CUDA) generator states
        trainer_state.json    step, tokens, data-sampler position, Python/NumPy RNG, policy
                              counters, best validation loss, the resolved config, versions
        manifest.json         sha256 and size of every file above; written last
      latest                  the newest checkpoint's folder name; replaced last

Under parallel=fsdp (checkpoint.format=auto or sharded) model.pt and the optimizer's tensors are
replaced by `shards/`, which every rank writes its own part of (torch.distributed.checkpoint, see
shards.py); optimizer.pt then holds the optimizer's parameter groups and the loss scaler. Either
layout resumes in any parallel mode and world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmtrain.checkpoint.shards import SHARDS
from llmtrain.core.files import CHECKPOINTS, TRAINER_STATE
from llmtrain.distributed.wrapping import ShardedModelState, ShardedOptimizerState
from llmtrain.engine.state import TrainState

FORMAT_VERSION = 1


LATEST = "latest"


MANIFEST = "manifest.json"


STATE_FILES = ("model.pt", "optimizer.pt", "rng.pt", TRAINER_STATE)


SHARDED_FILES = ("optimizer.pt", "rng.pt", TRAINER_STATE)  # + every file under shards/


@dataclass
class Checkpoint:
    """A verified checkpoint read back from disk. The tensors of a sharded one are read only when
    asked for: whole through `model`/`optimizer`, or each rank its shards through `load_into`."""

    path: Path
    full_state: tuple[dict[str, torch.Tensor], dict] | None  # (model, optimizer); None: not read yet
    scaler: dict | None
    rng: dict
    trainer: dict  # trainer_state.json
    shards: dict | None = None  # sharded layout: optimizer.pt's non-tensor part (shards.py)
    device: torch.device | str = "cpu"
    state: TrainState = field(init=False)

    def __post_init__(self) -> None:
        self.state = TrainState(**self.trainer["state"])

    @property
    def sharded(self) -> bool:
        return self.shards is not None

    @property
    def model(self) -> dict[str, torch.Tensor]:
        return self._full()[0]

    @property
    def optimizer(self) -> dict:
        return self._full()[1]

    def _full(self) -> tuple[dict[str, torch.Tensor], dict]:
        if self.full_state is None:
            from llmtrain.checkpoint.shards import read_full

            self.full_state = read_full(self.path / SHARDS, self.shards, self.device)
        return self.full_state

    def load_into(self, model_state: Any, optimizer_state: Any) -> None:
        """Weights and optimizer state into the run's state views (a plain model and optimizer, or
        distributed/wrapping.py's sharded and consolidated views): an FSDP2 run's sharded views read
        just their shards of a sharded checkpoint; anything else reads the whole."""
        if (self.sharded and isinstance(model_state, ShardedModelState)
                and isinstance(optimizer_state, ShardedOptimizerState)):
            from llmtrain.checkpoint.shards import read_shards_into

            read_shards_into(self.path / SHARDS, model_state.model, optimizer_state.optimizer, self.shards)
            return
        from llmtrain.engine.optim import dequantized, requantize_state

        # torchao's low-bit moments: FSDP2 splits a whole state across its ranks as floats only, and
        # a sharded checkpoint read whole hands them over as floats; either way they are quantized again.
        to_shards = isinstance(optimizer_state, ShardedOptimizerState)
        model_state.load_state_dict(self.model)
        optimizer_state.load_state_dict(dequantized(self.optimizer) if to_shards else self.optimizer)
        if self.sharded or to_shards:
            requantize_state(getattr(optimizer_state, "optimizer", optimizer_state))


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS
