"""threads=auto: the setting's parser, the pick from the free cores (fake /proc/stat readings), the
banner's words, and the mid-run slowdown warning on synthetic rates."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from rich.console import Console

from llmtrain.config.hydra import config_from_dict
from llmtrain.config.schema import Config, config_to_dict
from llmtrain.config.threads import parse_threads, threads_error
from llmtrain.config.validate import validate
from llmtrain.core.errors import ConfigError
from llmtrain.distributed.cores import CoreMeter, auto_threads, parse_proc_stat, pick_threads
from llmtrain.distributed.layout import Layout, resolve_threads
from llmtrain.engine.precision import NumericPrecision
from llmtrain.engine.state import TrainResult, TrainState
from llmtrain.engine.timing import StepTimer
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.training.banner import threads_text
from llmtrain.training.eta import StepClock
from llmtrain.training.progress import Progress
from llmtrain.training.throughput import SlowdownWatch

from .conftest import run_cli

# ---------------------------------------------------------------------------------------------
# the setting
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "count"), [("auto", None), ("AUTO", None), (None, None), (1, 1), (4, 4), ("3", 3)])
def test_the_setting_is_auto_or_a_count(value: object, count: int | None) -> None:
    assert parse_threads(value) == count
    assert threads_error(value) is None


@pytest.mark.parametrize("value", [0, -2, "many", "0", 2.5, True, "", [1]])
def test_a_bad_setting_gets_one_paragraph_naming_the_valid_values(value: object) -> None:
    with pytest.raises(ValueError):
        parse_threads(value)
    with pytest.raises(ConfigError) as err:
        validate(Config(threads=value))
    message = str(err.value)
    assert message.startswith("'threads' is ") and "\n" not in message
    assert "auto" in message and "threads=2" in message and "null" in message


def test_auto_is_the_default_and_an_old_configs_null_still_loads() -> None:
    assert Config().threads == "auto"
    old = config_to_dict(Config())
    old["threads"] = None  # a run dir's config.yaml from before threads=auto
    cfg = config_from_dict(yaml.safe_load(yaml.safe_dump(old)))
    validate(cfg)
    measured = []
    choice = resolve_threads(cfg.threads, Layout(), measure=lambda procs: measured.append(procs) or auto_threads(
        procs, meter=fake_meter([[0, 100], [0, 100]], [[0, 200], [0, 200]]), sleep=lambda s: None))
    assert measured == [1] and choice.threads == 2 and choice.reason == "auto: 2.0 of 2 cores free"
    assert resolve_threads(3, Layout(), measure=lambda procs: pytest.fail("a count is not measured")).threads == 3


def test_cli_refuses_a_bad_count_without_a_traceback(tmp_path: Path) -> None:
    proc = run_cli("check", "--no-compute", "threads=many", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "'threads' is many; use auto" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------
# the pick, from fake /proc/stat readings
# ---------------------------------------------------------------------------------------------


def proc_stat(cpus: list[list[int]], steal: int = 0) -> str:
    """/proc/stat with one line per CPU: [busy jiffies, idle jiffies] (busy as user time)."""
    total_busy, total_idle = sum(c[0] for c in cpus), sum(c[1] for c in cpus)
    lines = [f"cpu  {total_busy} 0 0 {total_idle} 0 0 0 {steal} 0 0"]
    lines += [f"cpu{i} {busy} 0 0 {idle} 0 0 0 {steal} 0 0" for i, (busy, idle) in enumerate(cpus)]
    return "\n".join([*lines, "intr 12345 0 0", "ctxt 999", "btime 1700000000"]) + "\n"


def fake_meter(before: list[list[int]], after: list[list[int]], own_s: float = 0.0, wall_s: float = 1.0,
               cpus: list[int] | None = None) -> CoreMeter:
    """A meter whose two readings are `before` and `after`, `wall_s` apart; this process used `own_s`
    CPU seconds in between."""
    readings = iter([proc_stat(before), proc_stat(after)])
    owns, clocks = iter([0.0, own_s]), iter([0.0, wall_s])
    return CoreMeter(cpus=cpus if cpus is not None else list(range(len(before))), read_stat=lambda: next(readings),
                     own_cpu=lambda: next(owns), clock=lambda: next(clocks))


def test_quiet_cores_are_all_used() -> None:
    choice = auto_threads(1, meter=fake_meter([[10, 100], [10, 100]], [[12, 198], [11, 199]]), sleep=lambda s: None)
    assert choice.threads == 2
    assert threads_text(choice.threads, 1, choice.reason) == "2 threads (auto: 2.0 of 2 cores free)"


def test_a_core_busy_elsewhere_leaves_one_thread() -> None:
    # cpu0 fully busy for the second sampled, cpu1 10% busy: 1.1 cores busy elsewhere, 0.9 free
    choice = auto_threads(1, meter=fake_meter([[0, 0], [0, 0]], [[100, 0], [10, 90]]), sleep=lambda s: None)
    assert choice.threads == 1 and choice.free_cores == pytest.approx(0.9)
    assert threads_text(choice.threads, 1, choice.reason) == "1 thread (auto: 1.1 of 2 cores busy elsewhere)"


def test_this_processs_own_spinning_threads_do_not_count_as_busy() -> None:
    # both cores fully busy, all of it this process's (its thread pool still spinning after the data preparation)
    choice = auto_threads(1, meter=fake_meter([[0, 0], [0, 0]], [[100, 0], [100, 0]], own_s=2.0), sleep=lambda s: None)
    assert choice.threads == 2 and choice.reason == "auto: 2.0 of 2 cores free"


def test_only_the_cores_this_process_may_use_are_counted() -> None:
    # affinity {2, 3}: cpu0 and cpu1 are busy but not ours
    meter = fake_meter([[0, 0]] * 4, [[100, 0], [100, 0], [0, 100], [0, 100]], cpus=[2, 3])
    choice = auto_threads(1, meter=meter, sleep=lambda s: None)
    assert (choice.threads, choice.cores) == (2, 2)


def test_local_processes_share_the_free_cores() -> None:
    meter = fake_meter([[0, 0]] * 8, [[100, 0], [100, 0]] + [[0, 100]] * 6)  # 6 of 8 free
    choice = auto_threads(2, meter=meter, sleep=lambda s: None)
    assert choice.threads == 3 and "2.0 of 8 cores busy elsewhere, shared by 2 local processes" in choice.reason
    assert threads_text(3, 2, choice.reason).startswith("3 threads per process (auto: ")


def test_steal_time_counts_as_busy() -> None:
    parsed = parse_proc_stat("cpu0 10 0 0 50 0 0 0 40 0 0\n", None)
    assert parsed == (50, 100, 1)


def test_the_pick_counts_a_core_only_when_most_of_it_is_free() -> None:
    assert [pick_threads(free, 2, 1) for free in (2.0, 1.85, 1.7, 1.0, 0.3, 0.0)] == [2, 2, 1, 1, 1, 1]
    assert pick_threads(15.5, 16, 1) == 15 and pick_threads(16, 16, 4) == 4
    assert pick_threads(5, 4, 1) == 4, "never more threads than cores"


def test_a_cgroup_quota_caps_the_free_cores() -> None:
    meter = fake_meter([[0, 0]] * 4, [[0, 100]] * 4)
    assert auto_threads(1, meter=meter, sleep=lambda s: None, quota=1.5).threads == 1


def test_without_proc_stat_a_small_matmul_is_timed() -> None:
    def unreadable() -> str:
        raise OSError("no /proc here")

    meter = CoreMeter(cpus=[0, 1], read_stat=unreadable)
    timed = {2: 0.30, 1: 0.12}  # 2 threads stall on a busy core
    choice = auto_threads(1, meter=meter, timed=timed.__getitem__, sleep=lambda s: None)
    assert choice.threads == 1 and "1 thread timed faster than 2" in choice.reason
    timed = {2: 0.07, 1: 0.12}
    assert auto_threads(1, meter=meter, timed=timed.__getitem__, sleep=lambda s: None).threads == 2


def test_a_slurm_task_uses_its_own_cores_unmeasured() -> None:
    meter = CoreMeter(cpus=list(range(16)), read_stat=lambda: pytest.fail("a SLURM task's cores are its own"))
    choice = auto_threads(1, meter=meter, slurm_cores=8)
    assert choice.threads == 8 and "SLURM" in choice.reason


def test_an_explicit_count_says_no_more_than_the_count() -> None:
    assert threads_text(1, 1) == "1 thread"
    assert threads_text(2, 4) == "2 threads per process"


# ---------------------------------------------------------------------------------------------
# the slowdown warning
# ---------------------------------------------------------------------------------------------


class BusyMeter(CoreMeter):
    """Every interval: `busy` cores of 2 busy elsewhere."""

    def __init__(self, busy: float) -> None:
        self.jiffies = 0
        super().__init__(cpus=[0, 1], read_stat=self._stat, own_cpu=lambda: 0.0, clock=self._clock)
        self.busy, self.now = busy, 0.0

    def _stat(self) -> str:
        self.jiffies += 100
        busy = round(self.jiffies * self.busy / 2)
        return proc_stat([[busy, self.jiffies - busy]] * 2)

    def _clock(self) -> float:
        self.now += 1.0
        return self.now


def watch(threads: int = 2, busy: float = 1.8) -> tuple[SlowdownWatch, list[str], list[dict]]:
    warnings: list[str] = []
    records: list[dict] = []
    return (
        SlowdownWatch(warnings.append, SimpleNamespace(write=records.append), threads, BusyMeter(busy)),
        warnings,
        records,
    )


def feed(slowdown: SlowdownWatch, rates: list[float], start: int = 10, clean: bool = True, stage: object = None) -> int:
    step = start
    for rate in rates:
        slowdown.interval(step, rate, clean, stage)
        step += 10
    return step


def test_a_collapse_warns_once_with_the_figures_and_what_helps() -> None:
    slowdown, warnings, records = watch()
    step = feed(slowdown, [20_000, 21_000, 21_000, 20_500, 21_000])
    step = feed(slowdown, [6_000, 6_000, 5_000, 6_000], start=step)
    assert len(warnings) == 1 and len(records) == 1
    assert warnings[0].startswith("tokens/s fell from 21,000 to 6,000 since step 50; other processes are using the "
                                  "CPU cores (1.8 of 2 busy): threads=1 or freeing the cores helps"), warnings[0]
    assert records[0]["kind"] == "slowdown" and records[0]["step"] == 70 and records[0]["since_step"] == 50
    assert records[0]["reference_tokens_per_s"] == 21_000 and records[0]["threads"] == 2


def test_one_slow_interval_or_a_mild_dip_is_no_collapse() -> None:
    slowdown, warnings, _ = watch()
    step = feed(slowdown, [20_000] * 5)
    step = feed(slowdown, [6_000, 20_000, 6_000, 19_000], start=step)  # never two in a row
    feed(slowdown, [16_000] * 20, start=step)  # 20% slower throughout
    assert warnings == []


def test_intervals_with_an_evaluation_or_a_save_do_not_count() -> None:
    slowdown, warnings, _ = watch()
    step = feed(slowdown, [20_000] * 5)
    step = feed(slowdown, [3_000] * 4, start=step, clean=False)
    assert warnings == []
    feed(slowdown, [20_000, 4_000, 4_000], start=step)
    assert len(warnings) == 1


def test_a_new_sequence_length_stage_starts_a_new_reference() -> None:
    slowdown, warnings, _ = watch()
    step = feed(slowdown, [20_000] * 5, stage=64)
    feed(slowdown, [8_000] * 10, start=step, stage=256)  # longer sequences: fewer tokens/s, by design
    assert warnings == []


def test_quiet_cores_are_not_blamed() -> None:
    slowdown, warnings, _ = watch(threads=1, busy=0.1)
    feed(slowdown, [20_000] * 5 + [5_000] * 2)
    assert "the CPU cores are not busy elsewhere (0.1 of 2)" in warnings[0] and "threads=1" not in warnings[0]


def test_progress_feeds_the_detector_its_intervals_and_pauses() -> None:
    """Progress, with a fake clock: 10-step intervals of 4,096-token steps; an evaluation inside an
    interval keeps that interval out; the collapse warns once, on the console."""
    now = [0.0]
    console = Console(file=io.StringIO(), width=300)
    sink = Dashboard(400, console)
    records: list[dict] = []
    metrics = SimpleNamespace(write=records.append)
    slowdown = SlowdownWatch(lambda message: sink.print(f"warning: {message}"), metrics, 2, BusyMeter(1.5))
    progress = Progress(log_interval=10, timer=StepTimer(0, torch.device("cpu")), dashboard=sink, metrics=metrics,
                        result=TrainResult(Path("."), 0, 0), flops_per_token=1.0, precision=NumericPrecision(),
                        sampler=None, stages=SimpleNamespace(staged=False), eta=StepClock(400, clock=lambda: now[0]),
                        slowdown=slowdown, clock=lambda: now[0])
    state = TrainState()
    progress.begin(state)
    loss = grad = torch.tensor(1.0)
    for step in range(1, 201):
        now[0] += 0.2 if step <= 120 else 0.8  # 20,480 tok/s, then 5,120 from step 121
        state.step, state.tokens = step, step * 4096
        progress.step_done(state, loss, grad, 1e-3, applied=True, last_step=False)
        if step == 60:
            now[0] += 30.0  # an evaluation
            progress.restart_clock(state.tokens)
    out = console.file.getvalue()
    assert out.count("warning: tokens/s fell from 20,480 to 5,120 since step 120") == 1, out
    assert [r["step"] for r in records if r["kind"] == "slowdown"] == [140]


def test_the_runs_own_other_ranks_are_not_busy_elsewhere() -> None:
    warnings: list[str] = []
    slowdown = SlowdownWatch(warnings.append, SimpleNamespace(write=lambda record: None), 1, BusyMeter(1.8),
                             sibling_cores=1.0)  # a second local rank with 1 thread
    feed(slowdown, [20_000] * 5 + [5_000] * 2)
    assert "(0.8 of 2 busy)" in warnings[0], warnings[0]
