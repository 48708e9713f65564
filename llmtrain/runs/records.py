"""The one reader of a run's logs, metrics.jsonl and events.jsonl (core/files.py names both and
every record kind): `report` and `compare` read a run through `read_records`.

Both files are what `metrics/writer.py's JsonlSink` appends, one JSON object per line. Reading tolerates what a
crash leaves behind: a line cut off mid-write (or anything else that is not a JSON object with a
"kind") is skipped, and so are bytes that are not UTF-8.

A `Records` answers in two views, because a resumed run takes the steps after its checkpoint again:

    of(kind)               the run as it finally went: for the step-keyed kinds (train, eval,
                           health, timing) the last record of each step wins, in step order; any
                           other kind is every record, metrics.jsonl's first, then events.jsonl's.
                           `last` and `series` read this view.
    written(kind, log)     one file's records of a kind in the order they were written, every take
                           of a redone step included.

Non-finite floats are written as the strings "nan", "inf", "-inf" (strict JSON): `number` reads a
value back as a float.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

from llmtrain.core.files import EVENTS, METRICS, Kind
from llmtrain.core.readers import read_lines

Record = dict[str, Any]

# Kinds logged at most once per step: a redone step's record replaces the first take's.
STEP_KINDS = (Kind.TRAIN, Kind.EVAL, Kind.HEALTH, Kind.TIMING)


def number(value: Any) -> float:
    """A record's value as a float ("nan"/"inf" strings included)."""
    return float(value)


class Records:
    """A run's records: `metrics` and `events` as the two files hold them, in the order written."""

    def __init__(self, metrics: Iterable[Record] = (), events: Iterable[Record] = ()) -> None:
        self.metrics = list(metrics)
        self.events = list(events)

    def written(self, kind: str, log: str = METRICS) -> list[Record]:
        """Every record of `kind` in `log` (files.METRICS or files.EVENTS), in the order written."""
        return [r for r in (self.metrics if log == METRICS else self.events) if r["kind"] == kind]

    @cached_property
    def _final(self) -> dict[str, list[Record]]:
        by_kind: dict[str, list[Record]] = {}
        for record in self.metrics + self.events:
            by_kind.setdefault(record["kind"], []).append(record)
        for kind in STEP_KINDS:
            latest: dict[int, Record] = {}
            for record in by_kind.get(kind, []):
                latest[int(record["step"])] = record  # a redone step replaces the first take
            by_kind[kind] = [latest[s] for s in sorted(latest)]
        return by_kind

    def of(self, kind: str) -> list[Record]:
        """The records of `kind` as the run finally went (see the module docstring)."""
        return self._final.get(kind, [])

    def last(self, kind: str) -> Record | None:
        records = self.of(kind)
        return records[-1] if records else None

    def series(self, kind: str, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of `key` in the records of `kind` that carry it (not null)."""
        steps, values = [], []
        for record in self.of(kind):
            if key in record and record[key] is not None:
                steps.append(int(record["step"]))
                values.append(number(record[key]))
        return steps, values


# One record is a few hundred bytes (a health record with per-block norms a few KB): a longer line is
# not a record, and the file is refused before that line is read whole.
RECORD_BYTES = 16 << 20


def _read_log(path: Path) -> list[Record]:
    """The records of a JSON-lines log, read one line at a time (core/readers.py: a regular file, no
    line past RECORD_BYTES); a line that is not a JSON record (cut by a crash) is passed over."""
    records = []
    for _, raw in read_lines(path, "a run's log", RECORD_BYTES):
        try:
            record = json.loads(raw.decode("utf-8", errors="replace"))
        except (ValueError, RecursionError):  # a line cut by a crash, or not a record at all
            continue
        if isinstance(record, dict) and "kind" in record:
            records.append(record)
    return records


def read_records(run_dir: Path) -> Records:
    """The records of the run in `run_dir`. Its metrics.jsonl must be a regular file (UnreadableFile
    otherwise: the callers say what a run dir is first); events.jsonl is optional (monitor off, other
    ranks)."""
    events = Path(run_dir) / EVENTS
    return Records(_read_log(Path(run_dir) / METRICS), _read_log(events) if events.is_file() else [])
