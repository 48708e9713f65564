"""threads=auto following the machine (issue 37): a run started beside a busy process, which then ends.

    python benchmarks/bench_threads_follow.py [--steps 800] [--hog-steps 200] [--quiet-steps 300]
                                              [--hogs 1] [--cpus 0,1] [--json out.json]

Two `llmtrain train` runs of nanoGPT's shakespeare-char CPU shape (4 layers x 128, context 64, batch
12; the default byte data, monitor on, evaluation, checkpoints and report off), threads=auto, as a
user starts them:

    quiet  on the machine as it is: its ms/step is the speed to reach
    busy   `--hogs` busy-loop processes, each pinned to one of the run's cores (the last ones),
           run before it starts (threads=auto counts their cores as taken) and are killed once the
           run logged step `--hog-steps`

Read from the busy run's metrics.jsonl: the step where the hogs ended (the last logged step at the
kill), the `threads` records (the trial and its verdict), ms/step before the hogs ended and after
the verdict, and the step from which the run runs at the quiet run's speed (a median of 3 log
intervals within 10% of it). Target: that step within 200 of the hogs' end. Beside them, every
second, the cores kept busy by work other than the benchmark's own processes: on a shared machine
the "quiet" machine may not be, and then no count is faster. `--cpus` pins both runs and the hogs
to those CPUs (a 2-core scenario on a bigger machine).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from llmtrain.config.schema import Config
from llmtrain.data import prepare_data
from llmtrain.distributed.cores import CoreMeter, measure_free_cores, parse_proc_stat

LOG_INTERVAL = 10
WITHIN = 0.10  # "at the quiet speed": ms/step within 10% of the quiet run's
OVERRIDES = ["model.block_size=64", "micro_batch_size=12", "global_batch_size=12", "eval_interval=0",
             "checkpoint=none", "report.enabled=false", f"log_interval={LOG_INTERVAL}", "device=cpu", "threads=auto"]
HOG = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def records(path: Path) -> list[dict]:
    """metrics.jsonl as written so far (a line still being written is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def start_train(run_dir: Path, steps: int, cpus: list[int] | None, console: Path) -> subprocess.Popen:
    with console.open("w") as out:  # a file, not a pipe: a pipe nobody reads fills up and stalls the run
        return subprocess.Popen([sys.executable, "-m", "llmtrain", "train", *OVERRIDES, f"max_steps={steps}",
                                 f"out_dir={run_dir}"], stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)


def interval_ms(metrics: list[dict]) -> list[tuple[int, float]]:
    """(step, ms/step of the log interval ending there), from the train records' elapsed time."""
    train = [(r["step"], r["elapsed_s"]) for r in metrics if r["kind"] == "train"]
    return [(s1, (e1 - e0) / (s1 - s0) * 1e3) for (s0, e0), (s1, e1) in zip(train, train[1:])]


def threads_line(console: str) -> str:
    """The banner's threads text ("1 thread (auto: 1.0 of 2 cores busy elsewhere)"), even where its
    table cell wrapped."""
    found = re.search(r"\d+ threads?(?: per process)? \(auto:[^)]*\)", " ".join(console.split()))
    return found.group(0) if found else ""


class OtherWork:
    """Cores of `cpus` kept busy by anything but the benchmark's own processes (this one, the run,
    the hogs), from /proc/stat and /proc/PID/stat: how quiet "quiet" really was on a shared machine."""

    def __init__(self, cpus: list[int]) -> None:
        self.cpus, self.tick = cpus, os.sysconf("SC_CLK_TCK")
        self.last: tuple[int, int, float, float] | None = None  # busy, total jiffies, own CPU s, wall
        self.pids: dict[int, float] = {}  # pid -> CPU seconds at the last sample
        self.counted = 0.0  # CPU seconds of those processes since the first sample (one that ended keeps its part)

    def cpu_s(self, pid: int) -> float | None:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None  # ended
        return (int(fields[11]) + int(fields[12])) / self.tick  # utime + stime, all its threads

    def sample(self, pids: list[int]) -> float | None:
        """Cores busy with other work since the last call (None on the first)."""
        parsed = parse_proc_stat(Path("/proc/stat").read_text(), self.cpus)
        times = os.times()
        now = time.monotonic()
        for pid in pids:
            seconds = self.cpu_s(pid)
            if seconds is not None:
                self.counted += seconds - self.pids.get(pid, seconds)
                self.pids[pid] = seconds
        own = times.user + times.system + self.counted
        if parsed is None:
            return None
        busy, total, cores = parsed
        last, self.last = self.last, (busy, total, own, now)
        if last is None or total <= last[1] or now <= last[3]:
            return None
        return max(0.0, cores * (busy - last[0]) / (total - last[1]) - (own - last[2]) / (now - last[3]))


def watched_run(tmp: Path, name: str, steps: int, cpus: list[int], pin: bool, hogs: list[subprocess.Popen],
                hog_steps: int) -> dict:
    """One `llmtrain train` run, watched: the hogs killed once it logged `hog_steps` (if any), and
    every second the cores other work kept busy, with the last step logged then."""
    path, console = tmp / name / "metrics.jsonl", tmp / f"{name}.out"
    other = OtherWork(cpus)
    proc = start_train(tmp / name, steps, cpus if pin else None, console)
    hog_end_step, timeline, next_sample = None, [], time.monotonic()
    other.sample([proc.pid, *(hog.pid for hog in hogs)])
    while proc.poll() is None:
        time.sleep(0.2)
        logged = [r["step"] for r in records(path) if r["kind"] == "train"]
        step = logged[-1] if logged else 0
        if hogs and hog_end_step is None and step >= hog_steps:
            for hog in hogs:
                hog.kill()
            hog_end_step = step
        if time.monotonic() >= next_sample:
            next_sample += 1.0
            busy = other.sample([proc.pid, *(hog.pid for hog in hogs if hog.poll() is None)])
            if busy is not None:
                timeline.append((step, busy))
    out = console.read_text()
    if proc.returncode != 0 or (hogs and hog_end_step is None):
        raise SystemExit(f"the {name} run failed (or ended before step {hog_steps}):\n{out}")
    return {"hog_end_step": hog_end_step, "metrics": records(path), "banner_threads": threads_line(out),
            "threads_lines": [line.strip() for line in out.splitlines() if line.strip().startswith("threads:")],
            "other_work": timeline}


def quiet_run(tmp: Path, steps: int, cpus: list[int], pin: bool) -> dict:
    run = watched_run(tmp, "quiet", steps, cpus, pin, [], 0)
    intervals = interval_ms(run["metrics"])
    steady = [ms for step, ms in intervals if step > 5 * LOG_INTERVAL] or [ms for _, ms in intervals]  # past warm-up
    return {**run, "ms_per_step": statistics.median(steady)}


def busy_run(tmp: Path, steps: int, hog_steps: int, hogs: int, cpus: list[int], pin: bool) -> dict:
    hog_procs = [subprocess.Popen([sys.executable, "-c", HOG, str(cpu)]) for cpu in cpus[-hogs:]]
    try:
        time.sleep(1.0)  # the hogs are running when start-up samples the cores
        return watched_run(tmp, "busy", steps, cpus, pin, hog_procs, hog_steps)
    finally:
        for hog in hog_procs:
            hog.kill()
            hog.wait()


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def analyse(busy: dict, quiet: dict) -> dict:
    """The figures of the busy run against the quiet one (see the module docstring)."""
    hog_end, quiet_ms = busy["hog_end_step"], quiet["ms_per_step"]
    intervals = interval_ms(busy["metrics"])
    switches = [r for r in busy["metrics"] if r["kind"] == "threads"]
    verdict = next((r for r in switches if r["phase"] == "kept" and r["step"] > hog_end), None)
    later = [(step, ms) for step, ms in intervals if step > hog_end]
    reached = next((later[i][0] for i in range(len(later))
                    if statistics.median(ms for _, ms in later[i:i + 3]) <= quiet_ms * (1 + WITHIN)), None)
    return {
        "hog_end_step": hog_end,
        "trial_step": next((r["step"] for r in switches if r["phase"] == "trial" and r["step"] > hog_end), None),
        "kept_step": verdict["step"] if verdict else None,
        "quiet_speed_step": reached,
        "steps_to_quiet_speed": reached - hog_end if reached is not None else None,
        "busy_ms_per_step": median_or_none([ms for step, ms in intervals if 5 * LOG_INTERVAL < step <= hog_end]),
        "after_ms_per_step": median_or_none([ms for step, ms in intervals
                                             if verdict is not None and step > verdict["step"] + LOG_INTERVAL]),
        "quiet_ms_per_step": quiet_ms,
        # how quiet the machine was besides the benchmark's own processes (a shared machine is not)
        "other_work_cores_quiet_run": median_or_none([busy_cores for _, busy_cores in quiet["other_work"]]),
        "other_work_cores_after_hogs": median_or_none([c for step, c in busy["other_work"] if step > hog_end]),
        "switches": [{k: r[k] for k in ("step", "phase", "from", "to", "why")} for r in switches],
        "quiet_switches": [{k: r[k] for k in ("step", "phase", "from", "to", "why")}
                           for r in quiet["metrics"] if r["kind"] == "threads"],
        "busy_banner": busy["banner_threads"], "quiet_banner": quiet["banner_threads"],
        "busy_intervals_ms": intervals, "busy_other_work": busy["other_work"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=800, help="steps of the busy run")
    parser.add_argument("--hog-steps", type=int, default=200, help="the hogs end once the busy run logged this step")
    parser.add_argument("--quiet-steps", type=int, default=300)
    parser.add_argument("--hogs", type=int, default=1, help="busy-loop processes, one per core")
    parser.add_argument("--cpus", type=lambda text: [int(c) for c in text.split(",")],
                        help="pin the runs and the hogs to these CPUs (default: this process's)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    console = Console()
    cpus = args.cpus or sorted(os.sched_getaffinity(0))
    prepare_data(Config().data, log=console.print)  # once, before any timing (the runs find it cached)
    free = measure_free_cores(CoreMeter(cpus), seconds=1.0)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        quiet = quiet_run(tmp, args.quiet_steps, cpus, pin=args.cpus is not None)
        console.print(f"quiet run: {quiet['ms_per_step']:.1f} ms/step, {quiet['banner_threads']}", highlight=False)
        for line in quiet["threads_lines"]:
            console.print(f"  {line}", highlight=False)
        busy = busy_run(tmp, args.steps, args.hog_steps, args.hogs, cpus, pin=args.cpus is not None)
        console.print(f"busy run: {busy['banner_threads']}", highlight=False)
        for line in busy["threads_lines"]:
            console.print(f"  {line}", highlight=False)
    figures = {**analyse(busy, quiet), "cpus": cpus, "hogs": args.hogs, "free_cores_at_start": free}
    table = Table(title=f"threads=auto following the machine: {len(cpus)} cores, {args.hogs} hog(s)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key in ("hog_end_step", "trial_step", "kept_step", "quiet_speed_step", "steps_to_quiet_speed"):
        table.add_row(key.replace("_", " "), str(figures[key]))
    for key in ("busy_ms_per_step", "after_ms_per_step", "quiet_ms_per_step", "other_work_cores_quiet_run",
                "other_work_cores_after_hogs"):
        table.add_row(key.replace("_", " "), f"{figures[key]:.2f}" if figures[key] is not None else "-")
    console.print(table)
    reached = figures["steps_to_quiet_speed"]
    console.print(f"quiet speed reached {reached} steps after the hogs ended (target <= 200)" if reached is not None
                  else "quiet speed NOT reached")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
