"""The pathology benchmark: does the health monitor catch a sick run, soon, name the right cause, and
does its fix cure the run?

    python benchmarks/pathologies.py                      # every case, 2 at a time: < 60 min on 2 cores
    python benchmarks/pathologies.py --half held-out      # one half of the split
    python benchmarks/pathologies.py --only lr_30x,c_seed1 --steps 60 --no-repair --no-rerun
    python benchmarks/pathologies.py --keep runs/ --json out.json --markdown table.md

The cases (benchmarks/pathology_cases.py) are small `llmtrain train` runs, one thread each: healthy
runs across models, tokenizers, batches, contexts, optimizers and schedules, and sick runs, each with
its TRUE cause (a cause id of `llmtrain/monitor/diagnosis.py`) and its shape, the healthy run it should
have been (a reference run of that shape always runs too). For each case the runner reads the run's
events.jsonl, metrics.jsonl and report.md and scores:

    detected     an alarm (or a non-finite event) in events.jsonl
    latency      steps from the first visible symptom to the first alarm (0 when the alarm comes first);
                 the first visible symptom is the first health check at which the run differs visibly
                 from its shape's reference (the same seed and data): the interval's mean loss apart
                 by > 0.15 nats and 5%, gradient norm apart by > 3x, or the LR apart by > 2x; a case
                 that never differs counts from its first check
    top cause    the first alarm's top-ranked cause (`causes[0].cause`) is the case's true cause
    flagged      before or during: the pre-flight check warned on an item that speaks of the true cause
                 (`pathology_cases.CHECK_ITEMS`, read from the run's `start` record), or it was detected
    report       the report's health verdicts: not all ok for a sick run, all ok for a healthy one
    false alarms alarms on a healthy run (target: none)
    repaired     (--repair) a sick run whose top cause is right, run again with monitor.repair=true:
                 repairable when it applied a repair (a `repair` event with applied true), cured when
                 its final validation loss is within 10% of its shape's reference's
    rerun        (--rerun) a sick run whose first alarm has a fix (`causes[0].fix`, config overrides),
                 run again with them (no repair): cured by the same rule

The cases are split, stratified by cause, into a tuning half and a held-out half (SPLIT_SEED); every
figure is given for both and overall. Tune the monitor on the tuning half: the held-out figures count.
The budget: at most ~52 min on 2 cores (`budget_seconds`: every sick case also repaired and rerun, from
a cost model of measured runs that errs high; ~20 s per 200-step run of 8 x 128 tokens).
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
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
import pathology_cases as pc  # noqa: E402

from llmtrain.training.repair import fix_lines  # noqa: E402

REFERENCE = "c_seed1337"  # the default shape's reference
CURED_MARGIN = 1.10  # cured: the final validation loss at most this many times the reference's
REPAIR = ("monitor.repair=true",)


@dataclass
class Score:
    case: str
    cause: str | None
    what: str
    half: str = ""
    shape: str = ""
    alarms: list[str] = field(default_factory=list)  # "name@step" in order
    detected: bool = False
    first_step: int | None = None
    symptom_step: int | None = None
    latency: int | None = None
    top_cause: str | None = None
    top_evidence: str = ""
    top_fix: str | None = None
    report_flags: list[str] = field(default_factory=list)  # report verdicts that are not ok
    check_warnings: list[str] = field(default_factory=list)  # the pre-flight items that warned or failed
    exit_code: int = 0
    seconds: float = 0.0
    val_loss: float | None = None  # the final evaluation's
    reference_val_loss: float | None = None
    repair_run: bool = False  # run again with monitor.repair=true
    repairs: list[dict] = field(default_factory=list)  # that run's repair events
    repaired: bool = False  # ... at least one applied
    repair_val_loss: float | None = None
    repair_cured: bool | None = None
    rerun_overrides: list[str] = field(default_factory=list)  # the first alarm's fix, rerun
    rerun_val_loss: float | None = None
    rerun_cured: bool | None = None

    @property
    def right_cause(self) -> bool:
        return self.cause is not None and self.top_cause == self.cause

    @property
    def flagged_before(self) -> bool:
        """The pre-flight check warned on an item that speaks of the true cause."""
        return self.cause is not None and bool(set(self.check_warnings) & set(pc.CHECK_ITEMS.get(self.cause, ())))

    @property
    def in_time(self) -> bool:
        return self.detected and self.latency is not None and self.latency <= 100


@dataclass(frozen=True)
class Job:
    case: pc.Case
    kind: str = ""  # "" (the case), "repair" or "rerun"
    extra: tuple[str, ...] = ()  # overrides over the case's

    @property
    def label(self) -> str:
        return f"{self.case.name}.{self.kind}" if self.kind else self.case.name


def command(job: Job, run_dir: Path, llmtrain: str, max_steps: int | None = None) -> list[str]:
    """The `llmtrain train` command line: pc.BASE, the length, the case's overrides, the job's, the run's
    own; each key once (`pc.merge_overrides`). `max_steps` caps the length (the fast subset)."""
    steps = job.case.steps if max_steps is None else min(job.case.steps, max_steps)
    overrides = pc.merge_overrides(pc.BASE, (f"max_steps={steps}",))
    for extra in (job.case.overrides, job.extra,
                  (f"out_dir={run_dir}", "allow_check_failures=true", "resume=never")):
        overrides = pc.merge_overrides(overrides, extra)
    return [llmtrain, "train", *overrides]


def run_job(job: Job, root: Path, llmtrain: str, max_steps: int | None = None) -> tuple[Path, int, float]:
    run_dir = root / job.label
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    start = time.perf_counter()
    with open(root / f"{job.label}.log", "w") as log:
        code = subprocess.run(command(job, run_dir, llmtrain, max_steps), stdout=log, stderr=subprocess.STDOUT,
                              env=env, check=False).returncode
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


def final_val_loss(run_dir: Path) -> float | None:
    """The last evaluation's validation loss (None: the run never evaluated)."""
    evals = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "eval" and "val_loss" in r]
    return _number(evals[-1]["val_loss"]) if evals else None


def cured(val_loss: float | None, reference: float | None) -> bool | None:
    """Within 10% of the reference's final validation loss; None when there is no reference to judge by."""
    if reference is None or not math.isfinite(reference):
        return None
    return val_loss is not None and math.isfinite(val_loss) and val_loss <= CURED_MARGIN * reference


def fix_overrides(fix: str | None) -> tuple[str, ...]:
    """The overrides a rerun with a cause's fix gets: its config lines as the repair reads them."""
    return tuple(f"{key}={value}" for key, value in fix_lines(fix).items())


def first_alarm(run_dir: Path) -> dict | None:
    return next((e for e in read_jsonl(run_dir / "events.jsonl") if e.get("kind") == "alarm"), None)


def top_of(alarm: dict | None) -> tuple[str | None, str, str | None]:
    """(cause, evidence, fix) of an alarm's top-ranked cause."""
    causes = (alarm or {}).get("causes") or []
    if not causes:
        return None, "", None
    return causes[0].get("cause"), causes[0].get("evidence", ""), causes[0].get("fix")


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


def check_warnings(run_dir: Path) -> list[str]:
    """The pre-flight items that warned or failed, as the run's `start` record keeps them."""
    start = next((r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "start"), {})
    return [item for item, status in (start.get("check") or {}).items() if status in ("WARN", "FAIL")]


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


def follow_ups(case: pc.Case, run_dir: Path, repair: bool, rerun: bool) -> list[Job]:
    """The sick case's repair run (its top cause is right) and its rerun with the fix (there is one)."""
    if case.cause is None:
        return []
    top, _, fix = top_of(first_alarm(run_dir))
    jobs = [Job(case, "repair", REPAIR)] if repair and top == case.cause else []
    if rerun and fix_overrides(fix):
        jobs.append(Job(case, "rerun", fix_overrides(fix)))
    return jobs


def _rounded(value: float | None) -> float | None:
    return round(value, 4) if value is not None and math.isfinite(value) else None


def score(case: pc.Case, done: dict[str, tuple[Path, int, float]]) -> Score:
    run_dir, code, seconds = done[case.name]
    events = read_jsonl(run_dir / "events.jsonl")
    alarms = [e for e in events if e.get("kind") == "alarm"]
    nonfinite = [e for e in events if e.get("kind") == "nonfinite"]
    result = Score(case.name, case.cause, case.what, pc.HALVES[case.name], case.shape, exit_code=code,
                   seconds=round(seconds, 1))
    result.alarms = [f"{a['alarm']}@{a['step']}" for a in alarms] + [f"nonfinite@{e['step']}" for e in nonfinite]
    result.detected = bool(alarms or nonfinite)
    result.report_flags = report_flags(run_dir)
    result.check_warnings = check_warnings(run_dir)
    result.top_cause, result.top_evidence, result.top_fix = top_of(alarms[0] if alarms else None)
    result.first_step = alarms[0]["step"] if alarms else (nonfinite[0]["step"] if nonfinite else None)
    reference_dir = done[pc.reference_of(case)][0]
    reference_val = final_val_loss(reference_dir)
    result.val_loss, result.reference_val_loss = _rounded(final_val_loss(run_dir)), _rounded(reference_val)
    if case.cause is None:
        return result
    sick, reference = health_by_step(run_dir), health_by_step(reference_dir)
    result.symptom_step = first_symptom(sick, reference) if reference else None
    start = result.symptom_step or min(sick, default=10)
    if result.first_step is not None:
        result.latency = max(0, result.first_step - start)
    if f"{case.name}.repair" in done:
        repair_dir = done[f"{case.name}.repair"][0]
        result.repair_run = True
        result.repairs = [e for e in read_jsonl(repair_dir / "events.jsonl") if e.get("kind") == "repair"]
        result.repaired = any(r.get("applied") for r in result.repairs)
        val = final_val_loss(repair_dir)
        result.repair_val_loss, result.repair_cured = _rounded(val), cured(val, reference_val)
    if f"{case.name}.rerun" in done:
        rerun_dir = done[f"{case.name}.rerun"][0]
        result.rerun_overrides = list(fix_overrides(result.top_fix))
        val = final_val_loss(rerun_dir)
        result.rerun_val_loss, result.rerun_cured = _rounded(val), cured(val, reference_val)
    return result


def _pct(part: int, whole: int) -> float | None:
    return round(100 * part / whole, 1) if whole else None


SUMMARY_ROWS = (("sick runs detected (an alarm or a non-finite step)", "detected", "sick"),
                ("... within 100 steps of the first symptom", "detected_in_time", "sick"),
                ("true cause ranked first", "right_cause", "sick"),
                ("sick runs flagged before (a pre-flight item of the cause warns) or during the run",
                 "flagged_or_detected", "sick"),
                ("healthy runs with any alarm (target: none)", "controls_with_alarms", "controls"),
                ("repaired runs (a repair applied) cured: val <= 1.10 x reference", "repaired_cured", "repairable"),
                ("rerun with the alarm's fix, cured", "rerun_cured", "reruns"))


def summarize(scores: Iterable[Score]) -> dict:
    scores = list(scores)
    sick = [s for s in scores if s.cause is not None]
    controls = [s for s in scores if s.cause is None]
    repaired = [s for s in sick if s.repaired]
    reruns = [s for s in sick if s.rerun_overrides]
    summary = {
        "sick": len(sick),
        "detected_in_time": sum(s.in_time for s in sick),
        "detected": sum(s.detected for s in sick),
        "right_cause": sum(s.right_cause for s in sick),
        "flagged_or_detected": sum(s.flagged_before or s.detected for s in sick),
        "report_flags_sick": sum(bool(s.report_flags) for s in sick),
        "controls": len(controls),
        "controls_with_alarms": sum(bool(s.alarms) for s in controls),
        "controls_with_report_flags": sum(bool(s.report_flags) for s in controls),
        "repair_runs": sum(s.repair_run for s in sick),
        "repairable": len(repaired),
        "repaired_cured": sum(s.repair_cured is True for s in repaired),
        "reruns": len(reruns),
        "rerun_cured": sum(s.rerun_cured is True for s in reruns),
    }
    for _, part, whole in SUMMARY_ROWS:
        summary[f"{part}_pct"] = _pct(summary[part], summary[whole])
    return summary


def _of(part: int, whole: int) -> str:
    return f"{part} of {whole} ({part / whole:.0%})" if whole else "-"


def _cured_cell(run: bool, val: float | None, ok: bool | None) -> str:
    if not run:
        return "-"
    return f"{val if val is not None else 'none'} {'✓' if ok else '✗' if ok is False else '?'}"


def markdown(scores: list[Score], summaries: dict[str, dict]) -> str:
    lines = ["| case | half | what | true cause | first alarm | symptom -> alarm | top cause | report | val (ref) "
             "| repaired | rerun |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in scores:
        first = s.alarms[0] if s.alarms else "none"
        latency = f"{s.symptom_step or '-'} -> {s.first_step} ({s.latency})" if s.latency is not None else "-"
        top = s.top_cause or "-"
        if s.cause is not None:
            top += " ✓" if s.right_cause else " ✗"
        report = ", ".join(s.report_flags) or "all ok"
        val = f"{s.val_loss} ({s.reference_val_loss})"
        repaired = _cured_cell(s.repair_run, s.repair_val_loss, s.repair_cured if s.repaired else None)
        if s.repair_run and not s.repaired:
            repaired = "no repair applied"
        rerun = _cured_cell(bool(s.rerun_overrides), s.rerun_val_loss, s.rerun_cured)
        lines.append(f"| {s.case} | {s.half} | {s.what} | {s.cause or 'healthy'} | {first} | {latency} | {top} | "
                     f"{report} | {val} | {repaired} | {rerun} |")
    halves = (pc.HELD_OUT, pc.TUNING, "all")
    lines += ["", f"| | {' | '.join(halves)} |", "|---|---|---|---|"]
    for title, part, whole in SUMMARY_ROWS:
        lines.append(f"| {title} | " + " | ".join(_of(summaries[h][part], summaries[h][whole]) for h in halves) + " |")
    lines += ["", f"The cases are split by SPLIT_SEED {pc.SPLIT_SEED}, stratified by true cause (healthy runs as one "
              "group), into a tuning half and a held-out half. **The held-out figures are the ones that count**: "
              "the monitor's thresholds may be tuned on the tuning half only."]
    return "\n".join(lines) + "\n"


def select(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[pc.Case]:
    """The cases asked for, with the references they are judged against, in CASES order."""
    names = set(args.only.split(",")) if args.only else set(pc.BY_NAME)
    unknown = names - set(pc.BY_NAME)
    if unknown:
        parser.error(f"unknown case(s) {', '.join(sorted(unknown))}; known: {', '.join(c.name for c in pc.CASES)}")
    if args.half != "all":
        names = {n for n in names if pc.HALVES[n] == args.half}
    names |= {pc.reference_of(pc.BY_NAME[n]) for n in names} | {REFERENCE}
    return [c for c in pc.CASES if c.name in names]


def run_all(cases: list[pc.Case], args: argparse.Namespace, root: Path) -> dict[str, tuple[Path, int, float]]:
    """Every case, longest first, `jobs` at a time; a sick case's repair and rerun start as soon as it ends."""
    done: dict[str, tuple[Path, int, float]] = {}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        pending: dict[Future, Job] = {}

        def submit(job: Job) -> None:
            pending[pool.submit(run_job, job, root, args.llmtrain, args.steps)] = job

        for case in sorted(cases, key=lambda c: -pc.estimated_seconds(c, args.steps)):
            submit(Job(case))
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                job = pending.pop(future)
                done[job.label] = future.result()
                print(f"  {job.label}: exit {done[job.label][1]}, {done[job.label][2]:.0f} s", flush=True)
                if not job.kind:
                    for follow in follow_ups(job.case, done[job.label][0], args.repair, args.rerun):
                        submit(follow)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated case names (their references always run too)")
    parser.add_argument("--half", choices=(pc.TUNING, pc.HELD_OUT, "all"), default="all",
                        help="run one half of the split (default all)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each (default 2)")
    parser.add_argument("--keep", type=Path, help="keep the run dirs here")
    parser.add_argument("--json", type=Path, help="write the scores as JSON")
    parser.add_argument("--markdown", type=Path, help="write the results table as Markdown")
    parser.add_argument("--steps", type=int, metavar="N",
                        help="cap every case's max_steps at N (a fast subset; a case whose pathology shows only "
                             "later, such as a schedule ending at step 100, is then no longer sick)")
    parser.add_argument("--repair", action=argparse.BooleanOptionalAction, default=True,
                        help="rerun each sick case whose top cause is right with monitor.repair=true (default on)")
    parser.add_argument("--rerun", action=argparse.BooleanOptionalAction, default=True,
                        help="rerun each sick case with its first alarm's fix (default on)")
    parser.add_argument("--llmtrain", default=str(Path(sys.executable).with_name("llmtrain")))
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: the cap on every case's max_steps must be a positive number of steps")
    cases = select(args, parser)
    root = args.keep or Path(tempfile.mkdtemp(prefix="pathologies-"))
    root.mkdir(parents=True, exist_ok=True)
    follow = int(args.repair) + int(args.rerun)
    estimate = pc.budget_seconds(cases, args.jobs, follow, args.steps) / 60
    print(f"{len(cases)} runs, up to {follow} more per sick case: at most ~{estimate:.0f} min", flush=True)
    started = time.perf_counter()
    done = run_all(cases, args, root)
    scores = [score(c, done) for c in cases]
    summaries = {half: summarize(s for s in scores if half == "all" or s.half == half)
                 for half in (pc.HELD_OUT, pc.TUNING, "all")}
    summary = summaries["all"] | {"wall_s": round(time.perf_counter() - started, 1)}
    table = markdown(scores, summaries)
    print(table)
    print(f"wall time {summary['wall_s']:.0f} s; run dirs in {root}")
    if args.json:
        args.json.write_text(json.dumps({
            "summary": summary, "summaries": summaries, "split_seed": pc.SPLIT_SEED, "split": pc.HALVES,
            "repair": args.repair, "rerun": args.rerun, "cases": [asdict(s) for s in scores]}, indent=1))
    if args.markdown:
        args.markdown.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
