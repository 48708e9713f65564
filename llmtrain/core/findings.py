"""A judged item, whoever judges it, and its written forms.

`llmtrain check` judges a config before a run, `llmtrain report` a run after it, `llmtrain doctor`
an experiment on a fresh model: each says of some item whether it is fine, what it saw, why that
matters and what fixes it. That is a `Finding`, with one `Status` vocabulary (PASS, WARN, FAIL, N/A)
and one set of renderers: the terminal (`render_table`, `render_lines`; a rich console, which writes
plain unwrapped lines when piped: core/console.py), Markdown (`markdown_table`, `markdown_section`)
and HTML (`html_table`, `html_section`).

What is a field of `Finding` and what is not: a field is here when a renderer shows it, as part of
what a reader is told about the item, whichever command judged it. Besides item, status, seen, why
and fix that is `details` (the evidence behind `seen`, a line each: the report's numbers behind a
verdict, the doctor's numbers beyond the deciding one) and `criterion` (the bar `seen` was held to:
the doctor's "pass when"; the check states its bars in `why`). What only one command works with
stays in that command's small wrapper that holds a Finding: the report's `Verdict` (the section's
key, the plots under it, the steps its loss plot marks: runs/report/verdict.py) and the doctor's
`Check` (everything measured, for the JSON file: doctor/bench.py). One class with every command's
extras would make each reader learn fields that mean nothing to it.

The status has two spellings, by where it stands: the table's label (`LABELS`: PASS, WARN, FAIL,
N/A; what the check and the doctor print, and what the `start` record keeps of each check row) and
the word in a sentence (`WORDS`: ok, warn, fail, n/a; the report's verdicts). Every renderer takes
the spelling; the colours (`STYLE`, `COLOURS`) are one per status everywhere.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.table import Table


class Status(str, Enum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    NA = "N/A"  # not judged: the question has no answer for this run (too short, nothing recorded)

    @classmethod
    def of(cls, passed: bool) -> Status:
        """PASS or FAIL: a measurement that has no warning band."""
        return cls.PASS if passed else cls.FAIL

    @property
    def word(self) -> str:
        """The status as a sentence says it: ok, warn, fail, n/a."""
        return WORDS[self]


LABELS: Mapping[Status, str] = {status: status.value for status in Status}
WORDS: Mapping[Status, str] = {Status.PASS: "ok", Status.WARN: "warn", Status.FAIL: "fail", Status.NA: "n/a"}
STYLE: Mapping[Status, str] = {Status.PASS: "bold green", Status.WARN: "bold yellow", Status.FAIL: "bold red",
                               Status.NA: "dim"}
COLOURS: Mapping[Status, str] = {Status.PASS: "#1a7f37", Status.WARN: "#b35900", Status.FAIL: "#c62828",
                                 Status.NA: "#666"}


@dataclass
class Finding:
    item: str  # what was judged: a check item, a report question, a doctor check
    status: Status
    seen: str  # what was seen: the value, the answer, the deciding number
    why: str = ""  # why it matters
    fix: str = ""  # what fixes it: an override, or for a code bug where to look
    details: list[str] = field(default_factory=list)  # the evidence behind `seen`, a line each
    criterion: str = ""  # the bar `seen` was held to ("pass when"); "" when `why` states it


@dataclass(frozen=True)
class Column:
    """One column of a findings table: its header, the Finding attribute it shows (item, status,
    seen, why, fix, criterion) and rich's column options (no_wrap, ratio, overflow)."""

    header: str
    attribute: str
    options: Mapping[str, Any] = field(default_factory=dict)


def badge(status: Status, words: Mapping[Status, str] = LABELS) -> str:
    """The status as rich markup, in its colour."""
    return f"[{STYLE[status]}]{words[status]}[/]"


# ---------------------------------------------------------------------------------------------
# the terminal
# ---------------------------------------------------------------------------------------------


def findings_table(findings: Sequence[Finding], columns: Sequence[Column], title: str, *,
                   words: Mapping[Status, str] = LABELS, title_justify: JustifyMethod = "center") -> Table:
    """A rich table of the findings; text is shown as written, never read as markup."""
    table = Table(title=escape(title), title_justify=title_justify)
    for column in columns:
        table.add_column(column.header, **column.options)
    for finding in findings:
        table.add_row(*(badge(finding.status, words) if c.attribute == "status"
                        else escape(getattr(finding, c.attribute)) for c in columns))
    return table


def render_table(console: Console, findings: Sequence[Finding], columns: Sequence[Column], title: str, *,
                 words: Mapping[Status, str] = LABELS, title_justify: JustifyMethod = "center",
                 notes: bool = False) -> None:
    """The table; with `notes`, under it each finding's details and, for one that did not pass, its fix
    (the doctor's measurements and what a failure points at)."""
    console.print(findings_table(findings, columns, title, words=words, title_justify=title_justify))
    if notes:
        for finding in findings:
            for line in finding.details:
                console.print(f"  {escape(finding.item)}: [dim]{escape(line)}[/]")
            if finding.status in (Status.FAIL, Status.WARN) and finding.fix:
                verb = "failed" if finding.status is Status.FAIL else "warned"
                console.print(f"  [{STYLE[finding.status]}]{escape(finding.item)} {verb}[/]: {escape(finding.fix)}")


def finding_line(finding: Finding, words: Mapping[Status, str] = LABELS) -> str:
    """'  FAIL mixed precision: fp16 on cpu, ...' as markup; a question is answered after a space
    ('  warn Is the loss curve smooth? 2 spikes ...')."""
    separator = " " if finding.item.endswith("?") else ": "
    return f"  {badge(finding.status, words)} [bold]{escape(finding.item)}[/]{separator}{escape(finding.seen)}"


def render_lines(console: Console, findings: Sequence[Finding], *, words: Mapping[Status, str] = LABELS,
                 reasons: bool = False, **print_options: Any) -> None:
    """A line per finding (`finding_line`); with `reasons`, its why and fix under it, indented to the
    item. `print_options` go to console.print (a caller that must keep a path whole soft-wraps)."""
    for finding in findings:
        console.print(finding_line(finding, words), **print_options)
        indent = " " * (3 + len(words[finding.status]))
        if reasons and finding.why:
            console.print(f"{indent}why: {escape(finding.why)}", **print_options)
        if reasons and finding.fix:
            console.print(f"{indent}fix: {escape(finding.fix)}", **print_options)


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def markdown_cell(text: str) -> str:
    """Text for a Markdown table cell: a bare | would end the cell."""
    return text.replace("|", "\\|")


def markdown_table(findings: Sequence[Finding], columns: Sequence[Column], *,
                   words: Mapping[Status, str] = LABELS) -> list[str]:
    """The findings as a Markdown table, one line each (the status in bold)."""
    lines = ["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
    for finding in findings:
        cells = [f"**{words[finding.status]}**" if c.attribute == "status"
                 else markdown_cell(getattr(finding, c.attribute)) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown_section(finding: Finding, *, words: Mapping[Status, str] = LABELS, level: int = 2) -> list[str]:
    """A section: the item as its heading, the status and what was seen, why and fix when given,
    and the details as a list."""
    lines = ["", f"{'#' * level} {finding.item}", "", f"**{words[finding.status]}**: {finding.seen}", ""]
    if finding.why:
        lines += [f"Why it matters: {finding.why}", ""]
    if finding.fix:
        lines += [f"Fix: {finding.fix}", ""]
    return lines + [f"- {line}" for line in finding.details]


# ---------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------


def html_badge(status: Status, words: Mapping[Status, str] = LABELS) -> str:
    """The status as a coloured label (the page's CSS styles .badge)."""
    return f'<span class="badge" style="background:{COLOURS[status]}">{html.escape(words[status])}</span>'


def html_table(findings: Sequence[Finding], columns: Sequence[Column], *, words: Mapping[Status, str] = LABELS,
               anchors: Sequence[str] | None = None) -> list[str]:
    """The findings as an HTML table: the header row, a row per finding, the closing tag. With
    `anchors` (one per finding) the item links to its section (`html_section`'s anchor)."""
    esc = html.escape
    rows = ["<table><tr>" + "".join(f"<th>{esc(c.header)}</th>" for c in columns) + "</tr>"]
    for i, finding in enumerate(findings):
        cells = []
        for c in columns:
            if c.attribute == "status":
                cells.append(html_badge(finding.status, words))
            elif c.attribute == "item" and anchors is not None:
                cells.append(f"<a href='#{esc(anchors[i])}'>{esc(finding.item)}</a>")
            else:
                cells.append(esc(getattr(finding, c.attribute)))
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    return rows + ["</table>"]


def html_section(finding: Finding, *, words: Mapping[Status, str] = LABELS, anchor: str | None = None) -> list[str]:
    """A section: the item and its status as the heading, what was seen, why and fix when given, and
    the details as a list."""
    esc = html.escape
    target = f" id='{esc(anchor)}'" if anchor else ""
    parts = [f"<h2{target}>{esc(finding.item)} {html_badge(finding.status, words)}</h2>", f"<p>{esc(finding.seen)}</p>"]
    if finding.why:
        parts.append(f"<p>Why it matters: {esc(finding.why)}</p>")
    if finding.fix:
        parts.append(f"<p>Fix: {esc(finding.fix)}</p>")
    if finding.details:
        parts.append("<ul>" + "".join(f"<li>{esc(line)}</li>" for line in finding.details) + "</ul>")
    return parts
