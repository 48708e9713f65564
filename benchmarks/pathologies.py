"""The pathology benchmark: does the health monitor catch a sick run, soon, and name the right cause?

    python benchmarks/pathologies.py                      # every case, 2 at a time; ~20 min on 2 cores
    python benchmarks/pathologies.py --only lr_30x,c_seed1 --json out.json --markdown table.md
    python benchmarks/pathologies.py --keep runs/         # keep the run dirs (default: a temp dir)

Each case is a small `llmtrain train` run (gpt_tiny, 8 x 128 tokens per step, one thread, 200 steps
unless the case says otherwise) with a set of overrides and, for a sick case, its TRUE cause: a
cause id of llmtrain's diagnosis (`llmtrain/monitor/diagnosis.py`). Healthy controls have no cause.
For each case the runner reads the run's events.jsonl, metrics.jsonl and report.md and scores:

    detected     an alarm (or a non-finite event) in events.jsonl
    latency      steps from the first visible symptom to the first alarm (0 when the alarm comes first);
                 the first visible symptom is the first health check at which the run differs visibly
                 from the healthy reference run (control `c_seed1337`, the same seed and data): the
                 interval's mean loss apart by > 0.15 nats and 5%, gradient norm apart by > 3x, or
                 the LR apart by > 2x;
                 a case that never differs counts from its first check
    top cause    the first alarm's top-ranked cause (`causes[0].cause`) is the case's true cause
    report       the report's health verdicts: not all ok for a sick run, all ok for a control
    false alarms alarms on a healthy control (target: none)

Targets (issue 17): >= 90% of sick cases detected within 100 steps of the symptom, the true cause
ranked first in >= 80%, 0 alarms on every control. The figures are recorded in docs/monitoring.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REFERENCE = "c_seed1337"
BASE = ("model=gpt_tiny", "global_batch_size=8", "data.seq_len=128", "threads=1", "eval_interval=100",
        "eval_batches=4", "log_interval=10", "seed=1337")


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[str, ...]
    cause: str | None  # the true cause (a diagnosis cause id); None for a healthy control
    steps: int = 200
    what: str = ""


CASES: tuple[Case, ...] = (
    Case("c_seed1337", (), None, what="the default config (the reference run)"),
    # ---- sick: the learning rate and its schedule ------------------------------------------------
    Case("lr_10x", ("optim.lr=0.03",), "lr_too_high", what="LR 10x the default (3.3x the sane maximum)"),
    Case("lr_30x", ("optim.lr=0.09",), "lr_too_high", what="LR 30x the default"),
    Case("lr_huge", ("optim.lr=1.0",), "lr_too_high", steps=100, what="LR 330x the default: diverges"),
    Case("no_warmup", ("optim.lr=0.01", "schedule.warmup_steps=0"), "no_warmup",
         what="no warmup at 3.3x the default LR"),
    Case("lr_too_low", ("optim.lr=1e-7",), "lr_too_low", what="LR 1e-7: the loss barely moves"),
    Case("schedule_ended", ("schedule.total_steps=100", "schedule.min_lr_ratio=0"), "schedule_ended",
         what="a 100-step schedule decaying to 0 in a 200-step run"),
    Case("no_clip_high_lr", ("optim.lr=0.02", "optim.clip_grad_norm=null"), "no_clipping",
         what="clipping off at 6.7x the default LR"),
    Case("weight_decay_high", ("optim.weight_decay=10",), "weight_decay_too_high", what="weight decay 10"),
    # ---- sick: initialization and architecture ----------------------------------------------------
    Case("init_too_small", ("model.init_std=1e-6",), "init_too_small", what="init std 1e-6"),
    Case("init_too_large", ("model.init_std=1.0",), "init_too_large", what="init std 1.0"),
    Case("residual_unscaled_deep", ("model.n_layer=16", "model.residual_init=plain", "model.init_std=0.05"),
         "residual_unscaled", what="16 blocks, plain residual init at std 0.05"),
    Case("post_ln_deep", ("model.n_layer=12", "model.norm_position=post"), "post_ln", what="12-block post-LN"),
    # ---- sick: precision and data -----------------------------------------------------------------
    Case("fp16_no_scaler", ("precision=fp16", "precision.loss_scaling=false"), "fp16_no_scaler", steps=30,
         what="fp16 without a loss scaler (slow on CPU: 30 steps)"),
    Case("unshuffled", ("data.shuffle=false",), "data_unshuffled", what="windows read in file order"),
    # ---- healthy controls -------------------------------------------------------------------------
    Case("c_seed1", ("seed=1",), None, what="another seed"),
    Case("c_seed2", ("seed=2",), None, what="another seed"),
    Case("c_modern", ("model=modern_tiny",), None, what="RMSNorm, RoPE, SwiGLU"),
    Case("c_deep", ("model.n_layer=8",), None, what="8 blocks"),
    Case("c_char", ("data.tokenizer=char",), None, what="char tokenizer"),
    Case("c_bpe", ("data.tokenizer=bpe",), None, what="BPE tokenizer"),
    Case("c_wsd", ("schedule=wsd",), None, what="warmup-stable-decay"),
    Case("c_linear", ("schedule=linear",), None, what="linear decay"),
    Case("c_bf16", ("precision=bf16",), None, steps=40, what="bf16 autocast (slow on CPU: 40 steps)"),
)


@dataclass
class Score:
    case: str
    cause: str | None
    what: str
    alarms: list[str] = field(default_factory=list)  # "name@step" in order
    detected: bool = False
    first_step: int | None = None
    symptom_step: int | None = None
    latency: int | None = None
    top_cause: str | None = None
    top_evidence: str = ""
    report_flags: list[str] = field(default_factory=list)  # report verdicts that are not ok
    exit_code: int = 0
    seconds: float = 0.0

    @property
    def right_cause(self) -> bool:
        return self.cause is not None and self.top_cause == self.cause

    @property
    def in_time(self) -> bool:
        return self.detected and self.latency is not None and self.latency <= 100


def run_case(case: Case, root: Path, llmtrain: str, max_steps: int | None = None) -> tuple[Path, int, float]:
    """Train one case; `max_steps` caps its length (the fast subset), None keeps the case's own."""
    run_dir = root / case.name
    steps = case.steps if max_steps is None else min(case.steps, max_steps)
    command = [llmtrain, "train", *BASE, f"max_steps={steps}", *case.overrides, f"out_dir={run_dir}",
               "allow_check_failures=true", "resume=never"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    start = time.perf_counter()
    with open(root / f"{case.name}.log", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=False).returncode
    return run_dir, code, time.perf_counter() - start


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut off by a killed run
    return records


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


def health_by_step(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "health"}


def first_symptom(sick: dict[int, dict], reference: dict[int, dict]) -> int | None:
    """The first check at which the sick run looks different from the healthy reference."""
    for step in sorted(sick):
        s, r = sick[step], reference.get(step)
        if r is None:
            continue
        # The mean loss of the interval (a single step's loss is too noisy to call a symptom).
        loss_s, loss_r = (_number(s.get("interval_loss", s.get("loss"))),
                          _number(r.get("interval_loss", r.get("loss"))))
        if not math.isfinite(loss_s) or (abs(loss_s - loss_r) > 0.15 and abs(loss_s - loss_r) > 0.05 * loss_r):
            return step
        grad_s, grad_r = _number(s.get("grad_norm")), _number(r.get("grad_norm"))
        if not math.isfinite(grad_s) or max(grad_s, grad_r) > 3 * max(min(grad_s, grad_r), 1e-12):
            return step
        lr_s, lr_r = _number(s.get("lr_applied")), _number(r.get("lr_applied"))
        if max(lr_s, lr_r) > 2 * max(min(lr_s, lr_r), 1e-30):
            return step
    return None


def report_flags(run_dir: Path) -> list[str]:
    """The report's verdicts that are not ok (its table's rows with WARN or FAIL)."""
    path = run_dir / "report.md"
    if not path.exists():
        return ["no report"]
    flags = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and any(c.strip("*").upper() in ("WARN", "FAIL") for c in cells):
            flags.append(cells[0])
    return flags


def score(case: Case, run_dir: Path, code: int, seconds: float, reference: dict[int, dict]) -> Score:
    events = read_jsonl(run_dir / "events.jsonl")
    alarms = [e for e in events if e.get("kind") == "alarm"]
    nonfinite = [e for e in events if e.get("kind") == "nonfinite"]
    result = Score(case.name, case.cause, case.what, exit_code=code, seconds=round(seconds, 1))
    result.alarms = [f"{a['alarm']}@{a['step']}" for a in alarms] + [f"nonfinite@{e['step']}" for e in nonfinite]
    result.detected = bool(alarms or nonfinite)
    result.report_flags = report_flags(run_dir)
    if alarms:
        first = alarms[0]
        causes = first.get("causes") or []
        result.first_step = first["step"]
        if causes:
            result.top_cause, result.top_evidence = causes[0].get("cause"), causes[0].get("evidence", "")
    elif nonfinite:
        result.first_step = nonfinite[0]["step"]
    if case.cause is not None:
        sick = health_by_step(run_dir)
        result.symptom_step = first_symptom(sick, reference) if reference else None
        start = result.symptom_step or min(sick, default=10)
        if result.first_step is not None:
            result.latency = max(0, result.first_step - start)
    return result


def summarize(scores: list[Score]) -> dict:
    sick = [s for s in scores if s.cause is not None]
    controls = [s for s in scores if s.cause is None]
    return {
        "sick": len(sick),
        "detected_in_time": sum(s.in_time for s in sick),
        "detected": sum(s.detected for s in sick),
        "right_cause": sum(s.right_cause for s in sick),
        "report_flags_sick": sum(bool(s.report_flags) for s in sick),
        "controls": len(controls),
        "controls_with_alarms": sum(bool(s.alarms) for s in controls),
        "controls_with_report_flags": sum(bool(s.report_flags) for s in controls),
    }


def markdown(scores: list[Score], summary: dict) -> str:
    lines = ["| case | what | true cause | first alarm | symptom -> alarm | top cause | report |",
             "|---|---|---|---|---|---|---|"]
    for s in scores:
        first = s.alarms[0] if s.alarms else "none"
        latency = f"{s.symptom_step or '-'} -> {s.first_step} ({s.latency})" if s.latency is not None else "-"
        top = s.top_cause or "-"
        if s.cause is not None:
            top += " ✓" if s.right_cause else " ✗"
        report = ", ".join(s.report_flags) or "all ok"
        lines.append(f"| {s.case} | {s.what} | {s.cause or 'healthy'} | {first} | {latency} | {top} | {report} |")
    n = summary["sick"] or 1
    lines += ["", f"Sick cases detected within 100 steps of the symptom: {summary['detected_in_time']} of "
              f"{summary['sick']} ({summary['detected_in_time'] / n:.0%}); true cause ranked first: "
              f"{summary['right_cause']} of {summary['sick']} ({summary['right_cause'] / n:.0%}); healthy controls "
              f"with an alarm: {summary['controls_with_alarms']} of {summary['controls']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated case names (the reference run is always included)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each (default 2)")
    parser.add_argument("--keep", type=Path, help="keep the run dirs here")
    parser.add_argument("--json", type=Path, help="write the scores as JSON")
    parser.add_argument("--markdown", type=Path, help="write the results table as Markdown")
    parser.add_argument("--steps", type=int, metavar="N",
                        help="cap every case's max_steps at N (a fast subset; a case whose pathology shows only "
                             "later, such as a schedule ending at step 100, is then no longer sick)")
    parser.add_argument("--llmtrain", default=str(Path(sys.executable).with_name("llmtrain")))
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: the cap on every case's max_steps must be a positive number of steps")
    names = set(args.only.split(",")) | {REFERENCE} if args.only else None
    unknown = names - {c.name for c in CASES} if names else set()
    if unknown:
        parser.error(f"unknown case(s) {', '.join(sorted(unknown))}; known: {', '.join(c.name for c in CASES)}")
    cases = [c for c in CASES if names is None or c.name in names]
    root = args.keep or Path(tempfile.mkdtemp(prefix="pathologies-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = dict(zip([c.name for c in cases],
                        pool.map(lambda c: run_case(c, root, args.llmtrain, args.steps), cases)))
    reference = health_by_step(done[REFERENCE][0])
    scores = [score(c, *done[c.name], reference) for c in cases]
    summary = summarize(scores) | {"wall_s": round(time.perf_counter() - started, 1)}
    table = markdown(scores, summary)
    print(table)
    print(f"wall time {summary['wall_s']:.0f} s; run dirs in {root}")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "cases": [asdict(s) for s in scores]}, indent=1))
    if args.markdown:
        args.markdown.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
