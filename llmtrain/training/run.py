"""What a run is made of: the parts `setup.build_run` builds, each in one phase and none changed
after it (parts.py, plan.py, and the loop's parts here), and `loop.fit` trains with.

    Run
      context   where and with what: config, processes, run dir, device and seed, data, the
                pre-flight check, the console, the checkpoint resumed from
      plan      every number derived from the config (plan.py)
      module    the model three ways, the optimizer, their state views for checkpoints, the
                trainable parameters and the precision (autocast, fp16's loss scaler)
      batches   the train sampler and the fixed validation batches
      loop      the metrics writer, monitor, checkpointer, recovery, evaluator, sequence-length
                stages and progress log, built after the banner
      state     the TrainState the loop carries (rebound after a rollback)
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.checkpoint.policy import Checkpointer
from llmtrain.engine.state import TrainResult, TrainState
from llmtrain.metrics.writer import MetricsWriter, NullMetricsWriter
from llmtrain.monitor.watch import Monitor, NullMonitor
from llmtrain.training.evaluator import Evaluator
from llmtrain.training.parts import Batches, Context, TrainModule
from llmtrain.training.plan import Plan
from llmtrain.training.progress import Progress
from llmtrain.training.recovery import Recovery
from llmtrain.training.stages import SeqLenStages


@dataclass(frozen=True)
class LoopParts:
    """The loop's side concerns, one component each, built together after the banner (the metrics
    writer opens files, and W&B prints)."""

    metrics: MetricsWriter | NullMetricsWriter
    result: TrainResult
    monitor: Monitor | NullMonitor
    checkpointer: Checkpointer
    recovery: Recovery
    evaluator: Evaluator
    stages: SeqLenStages
    progress: Progress


@dataclass
class Run:
    """Everything the step loop needs, built by `build_run`."""

    context: Context
    plan: Plan
    module: TrainModule
    batches: Batches
    loop: LoopParts
    state: TrainState  # the only field the loop rebinds: after a rollback, to the checkpoint's
