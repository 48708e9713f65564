"""How many CPU cores this process may use, and how many of them other processes keep busy: the
measurement behind `threads=auto` (the thread count picked at start-up, and followed mid-run by
training/threads_follow.py from samples between steps) and behind the mid-run slowdown warning
(training/throughput.py).

Why it matters: torch's OpenMP threads spin-wait for each other at the end of every op, so a
thread whose core another process holds stalls all of them. On 2 cores that other work used, 2
threads trained 3.5x slower than 1; on a quiet machine 2 threads are the faster. So `auto` counts
the cores that are free now and gives each local process its share of those.

Free cores come from /proc/stat: the busy time of the cores this process may run on (its CPU
affinity), sampled over a fraction of a second, less this process's own CPU time in that window
(its idle thread pool may still be spinning from the data preparation). Where /proc/stat is
missing (macOS, Windows) a small matmul is timed with all cores and with one instead. A cgroup CPU
quota (a container's `--cpus`) caps the cores.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SAMPLE_SECONDS = 0.25  # long enough for a few scheduler ticks on every core, short beside start-up
# A core counts as free when at least this much of it is: 2 threads where 1.85 of 2 cores are free
# beat 1 thread, at 1.5 they stall on the busy one (OpenMP spin-waits; see the module docstring).
FREE_CORE_SHARE = 0.8


# ---------------------------------------------------------------------------------------------
# The cores this process may use
# ---------------------------------------------------------------------------------------------


def allowed_cpus() -> list[int] | None:
    """The CPU numbers this process may run on (None where the platform does not say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return None


def cgroup_cpu_quota(read: Callable[[str], str] = lambda path: Path(path).read_text()) -> float | None:
    """Cores a cgroup v2 CPU quota allows (`docker run --cpus 1.5`: 1.5); None without a quota."""
    try:
        quota, period = read("/sys/fs/cgroup/cpu.max").split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(0.01, int(quota) / int(period))
    except (ValueError, ZeroDivisionError):
        return None


def usable_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup quota (rounded down, at least 1)."""
    cpus = allowed_cpus()
    count = len(cpus) if cpus is not None else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    return max(1, min(count, math.floor(quota))) if quota is not None else count


# ---------------------------------------------------------------------------------------------
# How busy they are
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuSample:
    """One reading: busy and total jiffies summed over the watched cores, this process's own CPU
    seconds (all its threads) and the wall clock."""

    busy: int
    total: int
    own_s: float
    wall_s: float


def parse_proc_stat(text: str, cpus: list[int] | None) -> tuple[int, int, int] | None:
    """(busy jiffies, total jiffies, cores counted) of the `cpuN` lines of /proc/stat for the CPUs
    in `cpus` (all of them when None); None when the text has none of them. Idle and iowait are
    idle; steal (a hypervisor giving the core to another machine) counts as busy."""
    wanted = set(cpus) if cpus is not None else None
    busy = total = cores = 0
    for line in text.splitlines():
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit()):
            continue
        if wanted is not None and int(name[3:]) not in wanted:
            continue
        values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal (guest is in user)
        if len(values) < 4:
            continue
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        total += sum(values)
        busy += sum(values) - idle
        cores += 1
    return (busy, total, cores) if cores else None


def _read_proc_stat() -> str:
    return Path("/proc/stat").read_text()


def _own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


class CoreMeter:
    """Samples how busy this process's cores are; `busy_elsewhere(a, b)` is the cores other
    processes kept busy between two samples. The readers are injectable (tests feed fake ones)."""

    def __init__(self, cpus: list[int] | None = None, read_stat: Callable[[], str] = _read_proc_stat,
                 own_cpu: Callable[[], float] = _own_cpu_seconds, clock: Callable[[], float] = time.monotonic) -> None:
        self.cpus = cpus if cpus is not None else allowed_cpus()
        self.read_stat, self.own_cpu, self.clock = read_stat, own_cpu, clock
        self.cores = len(self.cpus) if self.cpus is not None else (os.cpu_count() or 1)

    def sample(self) -> CpuSample | None:
        """A reading now; None where /proc/stat cannot be read (not Linux)."""
        try:
            parsed = parse_proc_stat(self.read_stat(), self.cpus)
        except (OSError, ValueError, IndexError):
            return None
        if parsed is None:
            return None
        busy, total, cores = parsed
        self.cores = cores
        return CpuSample(busy, total, self.own_cpu(), self.clock())

    def busy_elsewhere(self, before: CpuSample, after: CpuSample) -> float | None:
        """Cores other processes used between the samples (0 .. cores); None when no tick passed."""
        d_total, d_wall = after.total - before.total, after.wall_s - before.wall_s
        if d_total <= 0 or d_wall <= 0:
            return None
        busy_cores = self.cores * (after.busy - before.busy) / d_total
        own_cores = (after.own_s - before.own_s) / d_wall
        return min(float(self.cores), max(0.0, busy_cores - own_cores))


# ---------------------------------------------------------------------------------------------
# threads=auto
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count per process and why: `reason` is the banner's parenthesis ("" when the
    config set the count)."""

    threads: int
    reason: str = ""
    free_cores: float | None = None  # measured free cores (auto on Linux)
    cores: int | None = None  # usable cores


def pick_threads(free: float, cores: int, local_processes: int) -> int:
    """The free cores shared among the local processes, a core counted only when most of it is
    free (FREE_CORE_SHARE), at least 1 thread, at most the process's share of all the cores."""
    share = free / max(1, local_processes)
    return max(1, min(max(1, cores // max(1, local_processes)), math.floor(share + 1 - FREE_CORE_SHARE)))


def measure_free_cores(meter: CoreMeter, seconds: float = SAMPLE_SECONDS,
                       sleep: Callable[[float], None] = time.sleep) -> float | None:
    """Free cores (usable cores less those other processes keep busy), sampled over `seconds`;
    None where /proc/stat is missing."""
    before = meter.sample()
    if before is None:
        return None
    sleep(seconds)
    after = meter.sample()
    busy = meter.busy_elsewhere(before, after) if after is not None else None
    return None if busy is None else meter.cores - busy


def auto_threads(local_processes: int, meter: CoreMeter | None = None,
                 timed: Callable[[int], float] | None = None, sleep: Callable[[float], None] = time.sleep,
                 quota: float | None = None, slurm_cores: int | None = None) -> ThreadChoice:
    """What `threads=auto` picks on this machine now (see the module docstring)."""
    cores = usable_cores() if meter is None else meter.cores
    if slurm_cores:  # a SLURM task's cpus_per_task cores are its own: nobody else's work runs there
        threads = max(1, min(cores, slurm_cores))
        return ThreadChoice(threads, f"auto: the SLURM task's {slurm_cores} cores", None, cores)
    meter = meter or CoreMeter()
    free = measure_free_cores(meter, sleep=sleep)
    if free is not None:
        cores = meter.cores
        if quota is not None and quota < free:  # a container's quota caps the free cores
            free = quota
        threads = pick_threads(free, cores, local_processes)
        busy = cores - free
        reason = (f"auto: {free:.1f} of {cores} cores free" if busy < 0.5
                  else f"auto: {busy:.1f} of {cores} cores busy elsewhere")
        if local_processes > 1:
            reason += f", shared by {local_processes} local processes"
        return ThreadChoice(threads, reason, free, cores)
    share = max(1, cores // max(1, local_processes))
    if share == 1:
        return ThreadChoice(1, f"auto: {cores} core{'s' if cores != 1 else ''}"
                               f"{f' for {local_processes} local processes' if local_processes > 1 else ''}",
                            None, cores)
    timed = timed or time_matmul
    many, one = timed(share), timed(1)
    if one < many:
        return ThreadChoice(1, f"auto: 1 thread timed faster than {share} (the cores are busy elsewhere)", None, cores)
    return ThreadChoice(share, f"auto: {share} threads timed faster than 1", None, cores)


def time_matmul(threads: int, size: int = 256, repeats: int = 20) -> float:
    """Seconds for `repeats` small matmuls with `threads` threads (best of 3): the fallback
    measurement where /proc/stat is missing. Small on purpose: spin-waiting shows on small ops."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)  # a private generator: the run's RNG stays untouched
        a = torch.randn(size, size, generator=generator)
        a @ a
        best = math.inf
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(repeats):
                a @ a
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        torch.set_num_threads(before)
