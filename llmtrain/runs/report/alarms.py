"""Which alarms were raised, and what was done? The health monitor's alarms with their most likely
cause, the actions taken, the repairs (monitor.repair), non-finite steps, rollbacks and failed saves
(`alarms`); the alarm helpers the health section and the loss plot share."""

from __future__ import annotations

from typing import Any

from llmtrain.core.files import Kind
from llmtrain.core.findings import Finding
from llmtrain.runs.records import Record, Records
from llmtrain.runs.report.verdict import OK, WARN, Verdict, logged


def raised_alarms(records: Records) -> list[Record]:
    """The alarm records in the order raised, one per (alarm, step): a resume that redoes a step
    may log its alarm twice."""
    seen: set[tuple[str, Any]] = set()
    raised = []
    for alarm in logged(records, Kind.ALARM):
        key = (str(alarm.get("alarm", "?")), alarm.get("step"))
        if key not in seen:
            seen.add(key)
            raised.append(alarm)
    return raised


def top_cause(alarm: Record) -> dict | None:
    """The alarm's most likely cause (the first of its ranked `causes`); None for a record without
    them (runs from before the monitor ranked causes)."""
    causes = alarm.get("causes")
    if isinstance(causes, list) and causes and isinstance(causes[0], dict):
        return causes[0]
    return None


def cause_text(cause: dict, evidence: bool = True) -> str:
    """'Learning rate too high (LR 0.1 is 11x ...; fix: optim.lr=0.003)'; the title alone without
    `evidence`."""
    title = str(cause.get("title") or cause.get("cause") or "unnamed cause")
    extra = [str(cause["evidence"])] if evidence and cause.get("evidence") else []
    extra += [f"fix: {cause['fix']}"] if evidence and cause.get("fix") else []
    return title + (f" ({'; '.join(extra)})" if extra else "")


def _alarm_line(alarm: Record, action: str) -> str:
    """One alarm as the details list it: step, name, severity, the band it left, the action, the
    top-ranked cause when the record has one."""
    line = f"step {alarm.get('step')}: {alarm.get('alarm', '?')} ({alarm.get('severity', '?')})"
    if alarm.get("metric") is not None or alarm.get("band") is not None:
        line += f": {alarm.get('metric', '?')} left the band {alarm.get('band', '?')}"
    line += f" -> {action}"
    cause = top_cause(alarm)
    return line + (f"; most likely: {cause_text(cause)}" if cause else "")


def alarms(records: Records) -> Verdict:
    """The alarms raised (with their most likely cause when the record ranks causes) and the actions
    taken, non-finite steps, rollbacks and failed saves."""
    question = "Which alarms were raised, and what was done?"
    raised = raised_alarms(records)
    actions = logged(records, Kind.ACTION)
    rollbacks, save_errors = logged(records, Kind.ROLLBACK), logged(records, Kind.CHECKPOINT_ERROR)
    nonfinite = logged(records, Kind.NONFINITE)
    details = []
    for alarm in raised:
        taken = [a for a in actions if a.get("alarm") == alarm.get("alarm") and a.get("step") == alarm.get("step")]
        action = "; ".join(f"{a.get('action')}: {a.get('detail')}" for a in taken) or alarm.get("action") or "warn"
        details.append(_alarm_line(alarm, str(action)))
    repairs = logged(records, Kind.REPAIR)
    details += [repair_text(record) for record in repairs]
    for record in nonfinite:
        details.append(f"step {record.get('step')}: non-finite loss/gradient -> {record.get('action')}")
    for record in rollbacks:
        details.append(f"step {record.get('step')}: rolled back to step {record.get('to_step')} "
                       f"(LR scale {record.get('lr_scale')})")
    for record in save_errors:
        details.append(f"step {record.get('step')}: checkpoint save failed: {record.get('error')}")
    if not (raised or repairs or nonfinite or rollbacks or save_errors):
        return Verdict("alarms", Finding(question, OK, "none: every health check stayed in its band."))
    counts: dict[str, int] = {}
    for alarm in raised:
        counts[alarm.get("alarm", "?")] = counts.get(alarm.get("alarm", "?"), 0) + 1
    parts = [f"{name} x{n}" if n > 1 else name for name, n in counts.items()]
    applied = [r for r in repairs if r.get("applied")]
    if applied:
        parts.append(f"{len(applied)} repair(s): " + "; ".join(_changes(r) for r in applied))
    if len(applied) < len(repairs):
        parts.append(f"{len(repairs) - len(applied)} fix(es) that need a new run (the command is below)")
    if nonfinite:
        parts.append(f"{len(nonfinite)} non-finite step(s)")
    if rollbacks:
        parts.append(f"{len(rollbacks)} rollback(s)")
    if save_errors:
        parts.append(f"{len(save_errors)} failed save(s)")
    first = next(((a, c) for a in raised if (c := top_cause(a))), None)
    if first:
        parts.append(f"most likely cause of {first[0].get('alarm')} (step {first[0].get('step')}): "
                     f"{cause_text(first[1], evidence=False)}")
    return Verdict("alarms", Finding(question, WARN, "; ".join(parts) + " (details below and in events.jsonl).",
                                     details=details))


def _changes(record: Record) -> str:
    changes = record.get("changes") if isinstance(record.get("changes"), list) else []
    return ", ".join(f"{c.get('key')} {c.get('from')} -> {c.get('to')}" for c in changes if isinstance(c, dict))


def repair_text(record: Record) -> str:
    """One repair as the details list it: what was changed from what to what, and from which
    checkpoint; or the command that reruns with a fix the run could not apply."""
    head = (f"step {record.get('step')}: {record.get('alarm', '?')}, cause "
            f"{str(record.get('title') or record.get('cause') or '?').lower()}")
    if not record.get("applied"):
        return f"{head} -> needs a new run: {record.get('rerun')}"
    back = (f", after rolling back to step {record.get('rolled_back_to')}"
            if record.get("rolled_back_to") is not None else "")
    return f"{head} -> repaired: {_changes(record)}{back}"
