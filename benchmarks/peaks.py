"""Peak resident memory of short training runs, each process in a fresh interpreter (its peak is its
own): the rank script both memory benchmarks (bench_memory.py, bench_plan_memory.py) run, one
process or N under torchrun, and the records each process leaves.

A rank script computes `predicted` (bytes) and trains; `RECORD_PEAK`, appended to it, writes the
process's VmHWM (not ru_maxrss, which keeps the peak of the pre-exec fork) with the prediction to
OUT/peak<rank>.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RECORD_PEAK = """
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
record = {"rank": int(os.environ.get("RANK", 0)), "predicted": predicted,
          "measured": int(status["VmHWM"].split()[0]) * 1024}
with open(os.path.join(args["out"], f"peak{record['rank']}.json"), "w") as f:
    json.dump(record, f)
"""


def run_ranks(script: str, payload: dict, nproc: int, out: Path) -> list[dict] | str:
    """`script` (reading its JSON argument into `args`, with args["out"] == `out`) plus RECORD_PEAK,
    in one process or `nproc` under torchrun: each process's record, in rank order; or the last
    lines of stderr when it failed."""
    path = out / "rank.py"
    path.write_text(script + RECORD_PEAK)
    argument = json.dumps(payload)
    cmd = [sys.executable, str(path), argument] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(path),
        argument]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        return " | ".join(proc.stderr.strip().splitlines()[-5:])
    return [json.loads(p.read_text()) for p in sorted(out.glob("peak*.json"))]
