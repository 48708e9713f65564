"""When to save and what to keep: the loop's side of checkpointing (cadence, retention, the
best checkpoint, save failures)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmtrain.checkpoint.disk import describe_write_error, previous_checkpoint_bytes
from llmtrain.checkpoint.layout import checkpoint_root, step_dir_name
from llmtrain.checkpoint.read import list_checkpoints
from llmtrain.checkpoint.shards import SHARDS
from llmtrain.checkpoint.write import (
    CheckpointContents,
    ShardedFiles,
    newest_good_checkpoint,
    resume_point,
    save_checkpoint,
    staging_dir,
)
from llmtrain.config.schema import CheckpointConfig, SaveErrorPolicy
from llmtrain.core.errors import CheckpointSaveError, SaveFailed
from llmtrain.core.files import Kind
from llmtrain.engine.precision import NumericPrecision
from llmtrain.engine.state import TrainState


def apply_retention(run_dir: Path, keep_last: int, keep_step: int | None = None) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints and the one of `keep_step` (the best)."""
    checkpoints = list_checkpoints(run_dir)
    keep = set(checkpoints[:keep_last])
    if keep_step is not None:
        keep |= {p for p in checkpoints if p.name == step_dir_name(keep_step)}
    removed = []
    for path in checkpoints:
        if path not in keep:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _as_is(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class SavedObjects:
    """What a checkpoint holds besides the TrainState, each read through its state_dict() at a save:
    the state views of the model and the optimizer (the plain objects, or distributed/wrapping.py's
    sharded/consolidated views of them), the precision (fp16's loss scaler), the data sampler (its
    position), and more JSON state to keep (the run's seed, the health monitor's)."""

    model_state: Any
    optimizer_state: Any
    sampler: Any
    precision: NumericPrecision = field(default_factory=NumericPrecision)
    extra_state: Callable[[], dict] = dict


@dataclass(frozen=True)
class RankAgreement:
    """How the ranks of a run decide together. One process: every value is its own.

    writer: this rank writes the files (rank 0; the others take the same decisions, write nothing).
    agree(value): rank 0's value on every rank, so all ranks know whether a save succeeded (the
        final save after the loop is a collective under ZeRO-1/FSDP2: all or none retry it).
    vote(values): their element-wise sum over the ranks (signals and the clock differ per rank)."""

    writer: bool = True
    agree: Callable[[Any], Any] = _as_is
    vote: Callable[[list[float]], list[float]] = _as_is


class Checkpointer:
    """When to save (every N steps / M minutes, on a stop, at the end), what to keep, and what a
    failed save does."""

    def __init__(
        self, *, cfg: CheckpointConfig, run_dir: Path, saved: SavedObjects, config_dict: dict, metrics: Any,
        warn: Callable[[str], None], ranks: RankAgreement = RankAgreement(),
        shard_layout: tuple[int, int] | None = None, resumed_at: int | None = None,
    ) -> None:
        # metrics: anything with write(record) (a MetricsWriter).
        self.ranks = ranks
        self.writer, self.agree = ranks.writer, ranks.agree
        # (rank, world size): sharded files, every rank writing its own shards (the state views are
        # then distributed/wrapping.py's ShardedModelState / ShardedOptimizerState).
        self.shard_layout = shard_layout
        self.policy, self.run_dir, self.saved = cfg, run_dir, saved
        self.config_dict, self.metrics, self.warn = config_dict, metrics, warn
        self.last_saved_step: int | None = resumed_at  # a resumed run's checkpoint is its latest save
        self.last_saved_time = time.monotonic()
        self.last_val: tuple[int, float] | None = None  # (step, val loss) of the latest evaluation

    def due(self, step: int) -> bool:
        by_steps = self.policy.every_steps is not None and step % self.policy.every_steps == 0
        by_time = (self.policy.every_minutes is not None
                   and time.monotonic() - self.last_saved_time >= 60 * self.policy.every_minutes)
        return by_steps or by_time

    def decide(self, step: int, stop_requested: bool, last_step: bool) -> tuple[bool, bool]:
        """(stop, save) after `step`, the same on every rank: a stop anywhere stops (and saves) all,
        and so does a save that is due on any rank's clock."""
        saving = self.due(step) or stop_requested or (last_step and self.policy.final)
        stop_votes, save_votes = self.ranks.vote([float(stop_requested), float(saving)])
        return stop_votes > 0, save_votes > 0

    def evaluated(self, step: int, val_loss: float) -> None:
        """The latest evaluation: a save at this step can make it the best checkpoint."""
        self.last_val = (step, val_loss)

    def save_final(self, state: TrainState) -> None:
        """After the loop: the final checkpoint, unless this step is saved already (the loop's
        final save failed and is retried here, or a resumed run had no step left to take)."""
        if self.policy.final and self.last_saved_step != state.step:
            self.save(state)

    def save(self, state: TrainState) -> Path | None:
        """Save on every rank (a collective under ZeRO-1/FSDP2); the path on the writing rank."""
        if self.last_val is not None and self.last_val[0] == state.step and self.policy.keep_best:
            if state.best_val_loss is None or self.last_val[1] < state.best_val_loss:
                state.best_val_loss, state.best_step = self.last_val[1], state.step
        began = time.perf_counter()
        path, error = None, None
        try:
            if self.shard_layout is not None:
                path = self._save_sharded(state)
            else:
                # On every rank: under ZeRO-1/FSDP2 reading the full state gathers the shards.
                model, optimizer = self.saved.model_state.state_dict(), self.saved.optimizer_state.state_dict()
                if self.writer:
                    path = save_checkpoint(self.run_dir, self._contents(state, model=model, optimizer=optimizer))
        except CheckpointSaveError as err:
            error = str(err)
        # Rank 0's outcome decides for all: every rank then stops, warns or records the same save.
        error = self.agree(error)
        self.last_saved_time = time.monotonic()  # retry at the next due time, not at every step
        if error is not None:
            self.metrics.write({"kind": Kind.CHECKPOINT_ERROR, "step": state.step, "error": error})
            if self.policy.on_save_error is SaveErrorPolicy.stop:
                newest = self.agree(newest_good_checkpoint(self.run_dir) if self.writer else None)
                raise SaveFailed(f"{error}; stopping (checkpoint.on_save_error=stop). {resume_point(newest)}",
                                 checkpoint=newest, run_dir=self.run_dir)
            self.warn(f"{error}; training goes on, the previous checkpoints are intact (checkpoint.on_save_error=warn)")
            return None
        self.last_saved_step = state.step
        if self.writer:
            removed = apply_retention(self.run_dir, self.policy.keep_last,
                                      state.best_step if self.policy.keep_best else None)
            self.metrics.write({"kind": Kind.CHECKPOINT, "step": state.step, "path": str(path),
                                "seconds": time.perf_counter() - began, "removed": [p.name for p in removed]})
        return path

    def _contents(self, state: TrainState, **tensors: Any) -> CheckpointContents:
        """The checkpoint of `state`: the saved objects' states now, and `tensors` (the model's and
        optimizer's state dicts, or a sharded save's `shards`)."""
        saved = self.saved
        return CheckpointContents(state=state, config=self.config_dict, sampler=saved.sampler.state_dict(),
                                  precision=saved.precision.state_dict(), extras=saved.extra_state(), **tensors)

    def _save_sharded(self, state: TrainState) -> Path | None:
        """Every rank writes its shards into the folder rank 0 staged, and hashes a share of the
        files; rank 0 then writes the rest (optimizer groups, RNG, trainer state, manifest) and
        renames the folder into place. A failure anywhere leaves the previous checkpoints as they were."""
        from torch.distributed.checkpoint.api import CheckpointException

        from llmtrain.checkpoint.shards import ERROR_KEY, all_gather_dicts, hash_files, write_shards

        rank, world_size = self.shard_layout
        staged, error = None, None
        if self.writer:
            try:
                staged = staging_dir(self.run_dir, state.step)
            except OSError as err:
                where = checkpoint_root(self.run_dir)
                error = (f"could not save checkpoint {where / step_dir_name(state.step)}: "
                         f"{describe_write_error(err, where, self._sharded_bytes())}")
        staged, error = self.agree((staged, error))
        if staged is None:
            raise CheckpointSaveError(error)
        def failed(err: object) -> CheckpointSaveError:
            why = err if isinstance(err, str) else self._shard_error(err, staged)
            if self.writer:
                shutil.rmtree(staged, ignore_errors=True)
            return CheckpointSaveError(f"could not save the shards of checkpoint {staged}: {why}")

        try:
            non_tensor = write_shards(staged / SHARDS, self.saved.model_state.model,
                                      self.saved.optimizer_state.optimizer)
        except (OSError, RuntimeError, CheckpointException) as err:  # DCP raises on every rank
            raise failed(err) from None
        # A rank that cannot hash its share still joins the gather (with its error), or the
        # others would wait in it forever; then every rank fails the save together.
        try:
            share = hash_files(staged / SHARDS, rank, world_size)
        except OSError as err:
            share = {ERROR_KEY: f"rank {rank}: {err}"}
        files = all_gather_dicts(share, world_size)
        if ERROR_KEY in files:
            raise failed(files[ERROR_KEY])
        files = dict(sorted(files.items()))
        if not self.writer:
            return None
        return save_checkpoint(self.run_dir, self._contents(state, shards=ShardedFiles(staged, files, non_tensor)))

    def _shard_error(self, err: BaseException, staged: Path) -> str:
        """DCP's exception, rank by rank and without its tracebacks (its str() holds them all)."""
        needed = self._sharded_bytes()
        failures = getattr(err, "failures", None)
        if not failures:
            return describe_write_error(err, staged, needed)
        return "; ".join(f"rank {rank}: {describe_write_error(failure[0], staged, needed)}"
                         for rank, failure in sorted(failures.items()))

    def _sharded_bytes(self) -> int | None:
        """About what a sharded checkpoint takes: the previous one's size, else the weights and
        AdamW's two moments (the parameters' global sizes; every rank writes its part)."""
        previous = previous_checkpoint_bytes(self.run_dir)
        if previous is not None:
            return previous
        try:
            return 3 * sum(p.numel() * p.element_size() for p in self.saved.model_state.model.parameters())
        except (AttributeError, RuntimeError):
            return None
