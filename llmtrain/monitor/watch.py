"""The loop's side of the health monitor: what to measure on a check step, and where alarms go.

On a check step (every `monitor.interval` steps) the loop asks `Monitor` to take its numbers:
per-block gradient and parameter norms, the applied vs scheduled LR, memory, the share of time
spent waiting for data, and (every `activation_interval` steps, denser on a short run:
monitor/cadence.py) block-output activation stats from hooks installed for that step only. All of it
becomes floats in one host sync; `Detectors` judges them; new alarms are printed once with their
explanation, written to `events.jsonl`, and returned so the loop can act on them. After the
optimizer step, the update-to-parameter ratio completes the step's `health` record in
`metrics.jsonl`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from pathlib import Path

import torch

from llmtrain.config.schema import MonitorConfig
from llmtrain.core import faults, files
from llmtrain.core.files import Kind
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.metrics.writer import JsonlSink, MetricsWriter, NullMetricsWriter
from llmtrain.monitor.cadence import activation_every
from llmtrain.monitor.detectors import Alarm, Detectors, Sample
from llmtrain.monitor.diagnosis import RunFacts
from llmtrain.monitor.probes import (
    ActivationProbe,
    BlockSpan,
    block_norms,
    cuda_memory_mb,
    matmul_peak_flops,
    moment_sums,
    rss_mb,
    snapshot,
    subtract_in_place,
)

INTERVAL_LOSSES_KEPT = 1000  # a check interval's losses kept for its mean: bounded memory at any monitor.interval


class Monitor:
    """The monitor, as the loop sees it: one call per moment of the step (before/after the forward,
    the check, after the optimizer step), plus what a checkpoint, a rollback or a stop needs."""

    def __init__(self, cfg: MonitorConfig, model: torch.nn.Module, run_dir: Path, dashboard: Dashboard,
                 metrics: MetricsWriter | NullMetricsWriter, total_steps: int, *, fp16_without_scaler: bool = False,
                 flops_per_token: float = 0.0, write_events: bool = True, world_size: int = 1,
                 facts: RunFacts | None = None, peak_flops: float | None = None, span: BlockSpan | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.flops_per_token = flops_per_token
        self.world_size = world_size  # tokens/s counts all ranks; the peak is one device's
        # The MFU reference: the run's start-up measurement when given (measured once), else at the first check.
        self.peak_flops: float | None = peak_flops
        self.cfg, self.dashboard, self.metrics = cfg, dashboard, metrics
        self.fp16_without_scaler = fp16_without_scaler
        # Test-only hook (faults.py): keep this many MB alive per step, a leak the monitor must see.
        self.leak_mb = faults.leak_mb_per_step()
        self.leaked: list[bytearray] = []
        # The blocks and parameters this process measures (under pipeline parallel, its stages'),
        # and how its sums join the other processes' into the whole model's.
        self.span = span or BlockSpan.whole(model)
        self.blocks = self.span.modules
        self.block_params = [list(block.parameters()) for block in self.blocks]
        self.params = self.span.params
        self.monitor = Detectors(cfg, facts)
        self.optimizer = optimizer  # its moments: how consistent the gradient is from step to step
        self.events = JsonlSink(run_dir / files.EVENTS) if write_events else NullMetricsWriter()
        self.total_steps = total_steps
        # From the planned total, not the resume point: a resumed run samples the steps the
        # uninterrupted one does (sampling itself draws no random numbers).
        self.activation_every = activation_every(cfg, total_steps)
        self.probe: ActivationProbe | None = None
        self.before: list[torch.Tensor] | None = None
        self.before_norm = torch.zeros(())
        self.record: dict | None = None
        self.data_seconds = 0.0
        self.interval_start = time.perf_counter()
        self.interval_tokens = 0
        self.last_activations: dict[str, list[float]] = {}
        # This interval's step losses, read at the check (the last INTERVAL_LOSSES_KEPT of a long one).
        self.interval_losses: deque[torch.Tensor] = deque(maxlen=INTERVAL_LOSSES_KEPT)
        # The last check step's update ratio and its LR, judged at the next check (None: no update
        # was applied at the last check step, or there has been none yet).
        self.pending_update: tuple[float, float] | None = None
        self.check_lr = 0.0
        self.raised_at_eval: list[Alarm] = []  # alarms of an evaluation, acted on at the next check

    def is_check(self, step: int) -> bool:
        """`step` is the 1-based number of the step being taken."""
        return step % self.cfg.interval == 0

    def before_forward(self, step: int) -> None:
        if self.leak_mb:
            self.leaked.append(bytearray(b"\1" * int(self.leak_mb * 2**20)))
        if self.is_check(step) and step % self.activation_every == 0:
            self.probe = ActivationProbe(self.blocks)

    def waited_for_data(self, seconds: float) -> None:
        """Time the loop spent fetching a window: the check's data-wait share."""
        self.data_seconds += seconds

    def after_forward(self, loss: torch.Tensor) -> None:
        """The step's loss joins the interval's (kept on the device: no sync until the check)."""
        if self.probe is not None:
            self.probe.remove()
        self.interval_losses.append(loss.detach().reshape(1).float())

    def skip_check(self) -> None:
        """A step that is not checked (not a check step, or not finite): activations sampled on
        it are not reported later."""
        self.probe = None

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr_applied: float, lr_schedule: float,
              tokens: int, loss_scale: float | None) -> list[Alarm]:
        """Measure (one host sync), judge, report. Call after clipping, before the optimizer step."""
        device = loss.device
        span = self.span
        grads = span.per_block(block_norms(self.block_params, grads=True), squared=True)
        weights = span.per_block(block_norms(self.block_params, grads=False), squared=True)
        self.before_norm = span.norm(self.params)  # ||W|| before the update (after_step's ratio)
        parts = [loss.reshape(1).float(), grad_norm.reshape(1).float().to(device), self.before_norm.reshape(1),
                 interval_stats(self.interval_losses, loss).to(device),
                 self._joined(moment_sums(self.optimizer, self.params)).to(device), grads.to(device),
                 weights.to(device)]
        self.interval_losses.clear()
        stats = self.probe.stats() if self.probe is not None else None
        if stats is not None:
            parts += [span.per_block(torch.stack(stats[0])).to(device),
                      span.per_block(torch.stack(stats[1])).to(device)]
        self.probe = None
        values = torch.cat(parts).tolist()  # the check's one host sync
        n = span.count
        loss_v, grad_v, param_v, interval_loss, interval_var, interval_steps, resid_ss, resid_ssd = values[:8]
        moment_ratio = values[8] / values[9] if values[9] > 0 else None
        block_grads, block_params = values[10:10 + n], values[10 + n:10 + 2 * n]
        act_mean = values[10 + 2 * n:10 + 3 * n] if stats is not None else None
        act_var = values[10 + 3 * n:10 + 4 * n] if stats is not None else None
        now = time.perf_counter()
        tokens_per_s = (tokens - self.interval_tokens) / max(now - self.interval_start, 1e-9)
        if self.peak_flops is None:
            self.peak_flops = matmul_peak_flops(device)
        sample = Sample(step=step, loss=loss_v, grad_norm=grad_v, block_grad_norms=block_grads, param_norm=param_v,
                        lr_applied=lr_applied, lr_schedule=lr_schedule, rss_mb=rss_mb(), total_steps=self.total_steps,
                        fp16_without_scaler=self.fp16_without_scaler,
                        activation_mean=act_mean, activation_var=act_var, interval_loss=interval_loss,
                        interval_loss_var=interval_var, interval_steps=int(interval_steps),
                        interval_resid_ss=resid_ss, interval_resid_ssd=resid_ssd, moment_ratio=moment_ratio,
                        update_ratio=self.pending_update[0] if self.pending_update else None,
                        update_lr=self.pending_update[1] if self.pending_update else None)
        self.pending_update, self.check_lr = None, lr_applied
        self.record = {
            "kind": Kind.HEALTH, "step": step, "loss": loss_v, "grad_norm": grad_v, "block_grad_norms": block_grads,
            "param_norm": param_v, "block_param_norms": block_params, "interval_loss": interval_loss,
            "lr_applied": lr_applied,
            "lr_schedule": lr_schedule, "rss_mb": sample.rss_mb, "tokens_per_s": tokens_per_s,
            "data_wait_share": self.data_seconds / max(now - self.interval_start, 1e-9),
            "mfu": tokens_per_s * self.flops_per_token / (self.peak_flops * self.world_size),
            "peak_flops_per_s": self.peak_flops,
            **cuda_memory_mb(device),
        }
        if act_mean is not None:
            self.record["activation_mean"], self.record["activation_var"] = act_mean, act_var
        if moment_ratio is not None:
            self.record["moment_ratio"] = moment_ratio
        if loss_scale is not None:
            self.record["loss_scale"] = loss_scale
        self.data_seconds, self.interval_tokens = 0.0, tokens
        self.interval_start = time.perf_counter()  # the peak measurement is not training time
        if not math.isfinite(grad_v):
            # fp16: the loss scaler found an overflow and skips this step; it is not the run's gradient.
            self.dashboard.health({**self.last_activations, **self.record}, sorted(self.monitor.active))
            self.before = snapshot(self.params)
            return []
        alarms = self.monitor.check(sample)
        if self.monitor.step_correlation is not None:
            self.record["step_correlation"] = self.monitor.step_correlation
        self.report(alarms)
        alarms, self.raised_at_eval = self.raised_at_eval + alarms, []
        if act_mean is not None:
            self.last_activations = {"activation_mean": act_mean, "activation_var": act_var}
        # The dashboard shows the latest activation sample until the next one (every activation_every steps).
        self.dashboard.health({**self.last_activations, **self.record}, sorted(self.monitor.active))
        self.before = snapshot(self.params)  # for the update-to-parameter ratio
        return alarms

    def _joined(self, sums: torch.Tensor) -> torch.Tensor:
        """Sums of this process's parameters -> the whole model's (pipeline stages hold parts)."""
        return sums if self.span.join is None else self.span.join(sums)

    def report(self, alarms: list[Alarm]) -> None:
        for alarm in alarms:
            self.events.write(alarm.to_record())
            self.metrics.write(alarm.to_record())
            self.dashboard.alarm(alarm)

    def evaluated(self, step: int, val_loss: float) -> None:
        """An evaluation's validation loss: the overfitting alarm is judged on it, printed now and
        acted on with the next check's alarms (where the loop acts on alarms)."""
        alarms = self.monitor.validation(step, val_loss)
        self.report(alarms)
        self.raised_at_eval += alarms

    @property
    def facts(self) -> RunFacts | None:
        return self.monitor.facts

    def update_facts(self, facts: RunFacts) -> None:
        """The run's configuration changed (a repair): later alarms are diagnosed against the new one."""
        self.monitor.facts = facts

    def checkpoint_state(self) -> dict:
        """What a checkpoint keeps of the monitor (windows, counts, active alarms) and of this
        watch (the losses of the interval so far, the update ratio still to judge), so a resumed run
        judges exactly as the uninterrupted one would. Called at a save (which syncs anyway)."""
        losses = torch.cat(list(self.interval_losses)).tolist() if self.interval_losses else []
        return {"monitor": {**self.monitor.state_dict(), "interval_losses": losses,
                            "pending_update": list(self.pending_update) if self.pending_update else None}}

    def restore(self, monitor_state: dict | None) -> None:
        """The monitor as a checkpoint left it (a resume, a rollback): a recurring pattern is
        raised again. No state (an older checkpoint, or none): as it is."""
        if monitor_state:
            device = self.params[0].device
            self.interval_losses = deque(
                (torch.tensor([v], device=device) for v in monitor_state.get("interval_losses", [])),
                maxlen=INTERVAL_LOSSES_KEPT,
            )
            pending = monitor_state.get("pending_update")
            self.pending_update = (float(pending[0]), float(pending[1])) if pending else None
            self.monitor.load_state_dict(monitor_state)

    def forget_alarm(self, name: str) -> None:
        """Not active any more, so not saved as active: a resumed run that still shows the pattern
        raises it (and acts on it) again."""
        self.monitor.active.discard(name)

    def judge_afresh(self, name: str) -> None:
        """After a repair: not active, and its persistence starts over, so only a pattern that holds
        `patience` checks under the repaired settings raises the alarm again (Adam's moments, a
        restarted warmup, take a few steps to follow a new LR)."""
        self.monitor.active.discard(name)
        self.monitor.counts.pop(name, None)

    def restart_interval(self, tokens: int) -> None:
        """After a rollback the token count went back: tokens/s starts over from here, and the
        interval's losses are those of the steps taken from the checkpoint on."""
        self.interval_tokens, self.interval_start, self.data_seconds = tokens, time.perf_counter(), 0.0
        self.interval_losses.clear()

    def paused(self, seconds: float) -> None:
        """`seconds` just spent not training (an evaluation): left out of the interval's time, so
        tokens/s, MFU and the data-wait share measure training alone."""
        self.interval_start += seconds

    def nonfinite(self, record: dict) -> None:
        """A non-finite step and what it caused (skip, rollback, stop): part of the run's events."""
        self.events.write(record)

    def after_step(self, applied: bool) -> None:
        """Finish the check step's record with the update-to-parameter ratio ||dW|| / ||W||."""
        if self.record is None:
            return
        if applied and self.before is not None:
            update = self.span.norm(subtract_in_place(self.before, self.params))  # ||W_before - W_after||
            self.record["update_ratio"] = (update / self.before_norm.clamp_min(1e-12)).item()
            self.pending_update = (self.record["update_ratio"], self.check_lr)
        self.metrics.write(self.record)
        self.record, self.before = None, None

    def repaired(self, record: dict) -> None:
        """A repair (training/repair.py): one of the run's events."""
        self.events.write(record)
        self.metrics.write(record)

    def action_taken(self, alarm: Alarm, detail: str) -> None:
        record = {"kind": Kind.ACTION, "alarm": alarm.name, "step": alarm.step, "action": alarm.action,
                  "detail": detail}
        self.events.write(record)
        self.metrics.write(record)

    def close(self) -> None:
        if self.probe is not None:
            self.probe.remove()
        self.events.close()


def interval_stats(losses: deque[torch.Tensor], fallback: torch.Tensor) -> torch.Tensor:
    """The mean and the (unbiased) variance of the interval's finite step losses (non-finite steps
    were not trained on) and their count; then, for an interval of 4 or more steps all finite, the
    sum of squares of the losses around their least-squares line (the learning trend taken out) and
    of those residuals' successive differences, which independent steps make twice as large as
    neighbours that move together (0 and 0 otherwise). Five elements; with no losses, the check
    step's own loss, then zeros."""
    values = torch.cat(list(losses)) if losses else fallback.detach().reshape(1).float()
    finite = torch.isfinite(values)
    count = finite.sum()
    kept = torch.where(finite, values, 0.0)
    mean = kept.sum() / count.clamp_min(1)
    var = torch.where(finite, values - mean, 0.0).pow(2).sum() / (count - 1).clamp_min(1)
    n = values.numel()
    if n >= 4:
        t = torch.arange(n, device=values.device, dtype=values.dtype) - (n - 1) / 2
        slope = (t * (kept - mean)).sum() / t.pow(2).sum()
        residuals = kept - mean - slope * t
        whole = count == n
        ss = torch.where(whole, residuals.pow(2).sum(), 0.0)
        ssd = torch.where(whole, residuals.diff().pow(2).sum(), 0.0)
    else:
        ss = ssd = torch.zeros((), device=values.device)
    mean = torch.where(count > 0, mean, fallback.detach().float().reshape(()))
    return torch.stack([mean, torch.where(count > 1, var, torch.zeros_like(var)), count.float(), ss, ssd])


class NullMonitor:
    """The watch of a run with the monitor off (monitor.enabled=false): the same calls, none does
    anything, so the loop never asks whether there is a monitor."""

    def is_check(self, step: int) -> bool:
        return False

    def before_forward(self, step: int) -> None:
        pass

    def waited_for_data(self, seconds: float) -> None:
        pass

    def after_forward(self, loss: torch.Tensor) -> None:
        pass

    def skip_check(self) -> None:
        pass

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr_applied: float, lr_schedule: float,
              tokens: int, loss_scale: float | None) -> list[Alarm]:
        return []

    def evaluated(self, step: int, val_loss: float) -> None:
        pass

    facts = None

    def update_facts(self, facts: RunFacts) -> None:
        pass

    def checkpoint_state(self) -> dict:
        return {}

    def restore(self, monitor_state: dict | None) -> None:
        pass

    def forget_alarm(self, name: str) -> None:
        pass

    def judge_afresh(self, name: str) -> None:
        pass

    def restart_interval(self, tokens: int) -> None:
        pass

    def paused(self, seconds: float) -> None:
        pass

    def nonfinite(self, record: dict) -> None:
        pass

    def after_step(self, applied: bool) -> None:
        pass

    def repaired(self, record: dict) -> None:
        pass

    def action_taken(self, alarm: Alarm, detail: str) -> None:
        pass

    def close(self) -> None:
        pass
