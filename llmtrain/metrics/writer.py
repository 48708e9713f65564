"""Where a run's records go: metrics.jsonl always, TensorBoard and W&B when asked for, through one
`MetricsWriter`; a rank other than 0 gets a `NullMetricsWriter`."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from llmtrain.core.console import warn_on_stderr
from llmtrain.core.errors import UserError
from llmtrain.core.files import METRICS, Kind, json_safe


class JsonlSink:
    """One JSON object per line, each appended whole and unbuffered, so a crashed run keeps what
    it logged and a full disk never leaves half a line (nor stops the run: see `_append`)."""

    def __init__(self, path: Path, warn: Callable[[str], None] | None = None) -> None:
        self.path = Path(path)
        self.file = open(self.path, "ab", buffering=0)
        self.warn = warn or warn_on_stderr
        self.dropped = 0

    def write(self, record: dict[str, Any]) -> None:
        # Strict JSON has no NaN/Infinity: write them as the strings "nan", "inf", "-inf".
        line = (json.dumps(json_safe(record), allow_nan=False) + "\n").encode()
        if not self.file.closed:
            self._append(self.file, line)
            return
        # A record after close (the end of a run writes its last peaks once the weights are out)
        # is appended through a handle of its own, rather than raising or being lost.
        try:
            with open(self.path, "ab", buffering=0) as fh:
                self._append(fh, line)
        except OSError as err:
            self._dropped(err)

    def _append(self, fh: BinaryIO, line: bytes) -> None:
        """Write `line` whole, or drop it: a failed write (disk full) is cut off again, so the
        file stays whole lines and the earlier records intact; training goes on, warned once."""
        start = fh.seek(0, os.SEEK_END)
        try:
            view = memoryview(line)
            while view:
                view = view[fh.write(view):]  # a raw write may be short on a nearly full disk
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(fh.fileno(), start)
            self._dropped(err)

    def _dropped(self, err: OSError) -> None:
        self.dropped += 1
        if self.dropped == 1:
            self.warn(f"could not append to {self.path} ({err}); its records are dropped while that lasts "
                      "(the ones before are intact)")

    def close(self) -> None:
        self.file.close()
        if self.dropped:
            self.warn(f"{self.dropped} record(s) could not be written to {self.path} (see above)")


SKIP_KEYS = {"kind", "step", "time", "alarm", "action", "path", "removed", "error", "band", "severity", "metric",
             "detail", "resumed_from"}


# Record kinds the dashboards skip (no curve to draw) and the ones they show as text.
NOT_PLOTTED = (Kind.START, Kind.CHECKPOINT, Kind.CHECKPOINT_ERROR)
EVENT_KINDS = (Kind.ALARM, Kind.ACTION)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record as flat `kind/key[/index]` scalars (NaN kept: a dashboard shows where it happened);
    an evaluation task's as `eval_task/<task entry>/<metric>`, one curve per task and metric."""
    kind, out = record.get("kind", ""), {}
    prefix = f"{kind}/{record.get('task')}" if kind == Kind.EVAL_TASK else kind
    for key, value in record.items():
        if key in SKIP_KEYS or (kind == Kind.EVAL_TASK and key == "task"):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}/{key}"] = float(value)
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            out.update({f"{prefix}/{key}/{i}": float(v) for i, v in enumerate(value)})
    return out


def event_text(record: dict[str, Any]) -> str:
    return f"step {record.get('step')}: {record.get('alarm', '')} -> {record.get('action')} {record.get('detail', '')}"


class TensorBoardSink:
    """Scalars of every metrics record for TensorBoard (`pip install 'llmtrain[tensorboard]'`)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step, kind = record.get("step"), record.get("kind", "")
        if step is None or kind in NOT_PLOTTED:
            return
        if kind in EVENT_KINDS:  # events are text, not scalars
            self.writer.add_text(f"events/{kind}", event_text(record), step)
            return
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Weights & Biases (`pip install 'llmtrain[wandb]'`); `offline` writes RUN_DIR/wandb/ with no network,
    to upload later with `wandb sync`."""

    def __init__(self, run_dir: Path, mode: str, project: str, config: dict) -> None:
        import wandb  # an optional extra: imported only when asked for

        try:
            self.run = wandb.init(mode=mode, dir=str(run_dir), project=project, config=config, name=Path(run_dir).name)
        except Exception as err:  # no network, no API key, ...: the user's setting, said in one paragraph
            raise UserError(
                f"W&B could not start (wandb={mode}): {' '.join(str(err).split())[:300].rstrip('.')}. "
                "Use wandb=offline (no network; "
                "upload later with `wandb sync`), log in with `wandb login`, or set wandb=off."
            ) from None

    def write(self, record: dict[str, Any]) -> None:
        step, kind = record.get("step"), record.get("kind", "")
        if step is None or kind in NOT_PLOTTED:
            return
        values: dict[str, Any] = scalars(record) if kind not in EVENT_KINDS else {f"events/{kind}": event_text(record)}
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class NullMetricsWriter:
    """Where a rank other than 0 writes its records: nowhere (rank 0 writes the run's files)."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class MetricsWriter:
    """metrics.jsonl, plus TensorBoard and W&B when asked for: one `write` feeds them all."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, wandb: str = "off", wandb_project: str = "llmtrain",
                 config: dict | None = None, warn: Callable[[str], None] | None = None) -> None:
        self.jsonl = JsonlSink(run_dir / METRICS, warn)
        self.sinks: list[Any] = [self.jsonl]
        if tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        if wandb != "off":
            self.sinks.append(WandbSink(run_dir, wandb, wandb_project, config or {}))
        self.closed = False

    def write(self, record: dict[str, Any]) -> None:
        # After close, metrics.jsonl (the run's record, which report and compare read) still gets
        # the record; TensorBoard and W&B are finished and cannot take more.
        for sink in [self.jsonl] if self.closed else self.sinks:
            sink.write(record)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sink in self.sinks:
            sink.close()
