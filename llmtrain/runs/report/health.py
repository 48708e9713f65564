"""The section over the health plots (learning rate, gradient norm, parameter norm, activations):
its verdict is the monitor's, ok only when no alarm fired (`health_quantities`). Not one of the
questions: the summary table leaves it out, its section follows theirs."""

from __future__ import annotations

from llmtrain.core.files import Kind
from llmtrain.core.findings import Finding
from llmtrain.runs.records import Record, Records
from llmtrain.runs.report.alarms import cause_text, raised_alarms, top_cause
from llmtrain.runs.report.verdict import NA, OK, WARN, Verdict, logged, steps_text

HEALTH_PLOTS = ["lr.png", "grad_norm.png", "param_norm.png", "activations.png"]


def _alarm_summary(raised: list[Record]) -> list[str]:
    """Per alarm name, in the order first raised: 'grad_norm_high at step 30 (most likely: Learning
    rate too high)'."""
    by_name: dict[str, list[Record]] = {}
    for alarm in raised:
        by_name.setdefault(str(alarm.get("alarm", "?")), []).append(alarm)
    parts = []
    for name, records in by_name.items():
        cause = next((c for c in map(top_cause, records) if c), None)
        parts.append(f"{name} at {steps_text([r.get('step') for r in records])}"
                     + (f" (most likely: {cause_text(cause, evidence=False)})" if cause else ""))
    return parts



def health_quantities(records: Records, plots: list[str]) -> Verdict:
    """The section over the health plots: its verdict is the monitor's, ok only when no alarm fired
    and no step was non-finite."""
    question = "The health quantities over the run"
    raised, nonfinite = raised_alarms(records), logged(records, Kind.NONFINITE)
    what = ("learning rate, gradient norm, parameter norm, block activations (the monitor's bands are in "
            "docs/monitoring.md)")
    if raised or nonfinite:
        parts = [f"{len(raised)} alarm(s) fired: " + "; ".join(_alarm_summary(raised))] if raised else []
        if nonfinite:
            parts.append(f"{len(nonfinite)} non-finite step(s) at {steps_text([r.get('step') for r in nonfinite])}")
        # The evidence and the actions are listed once, under the alarms question.
        return Verdict("curves", Finding(question, WARN, "; ".join(parts)
                                         + f" (evidence and actions under the alarms question). The plots: {what}."),
                       plots=plots)
    if not records.of(Kind.HEALTH):
        return Verdict("curves", Finding(question, NA, f"no health checks recorded (monitor off?); the plots: {what}."),
                       plots=plots)
    return Verdict("curves", Finding(question, OK, f"every health check stayed in its band; the plots: {what}."),
                   plots=plots)
