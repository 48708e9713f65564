"""A report written out: Markdown (report.md), self-contained HTML (report.html), and the
terminal (the whole table, or the short lines: report.console). The verdicts go through the findings
renderers (core/findings.py), in the report's words (ok, warn, fail, n/a); the page around them, the
facts, the plots and the Evaluation section are the report's own."""

from __future__ import annotations

import base64
import html
from typing import Any

from rich.markup import escape

from llmtrain.config.schema import REPORT_FULL_AFTER_S
from llmtrain.core.findings import (
    WORDS,
    Column,
    html_section,
    html_table,
    markdown_cell,
    markdown_section,
    markdown_table,
    render_lines,
    render_table,
)
from llmtrain.runs.report.verdict import FAIL, NA, OK, WARN, Evaluation, Report, Verdict

# The summary table of the questions; the health section (key "curves") has a verdict but no row.
COLUMNS = [Column("question", "item"), Column("verdict", "status"), Column("finding", "seen", {"overflow": "fold"})]


def _questions(report: Report) -> list[Verdict]:
    return [v for v in report.verdicts if v.key != "curves"]


def to_markdown(report: Report) -> str:
    lines = [f"# {report.title}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {markdown_cell(v)} |" for k, v in report.facts]
    lines += ["", "## Verdicts", "", *markdown_table([v.answer for v in _questions(report)], COLUMNS, words=WORDS)]
    for verdict in report.verdicts:
        lines += markdown_section(verdict.answer, words=WORDS)
        lines += ["", *_plots_markdown(report, verdict.plots)]
    if report.evaluation is not None:
        lines += _evaluation_markdown(report, report.evaluation)
    return "\n".join(lines) + "\n"


def _plots_markdown(report: Report, names: list[str]) -> list[str]:
    """An image per plot drawn; the one line of a plot left out, in italics (its own paragraph)."""
    out = []
    for name in names:
        if name in report.plots:
            out.append(f"![{name}](report/{name})")
        elif name in report.left_out:
            out += [f"*{report.left_out[name]}*", ""]
    return out


def _evaluation_markdown(report: Report, section: Evaluation) -> list[str]:
    lines = ["", "## Evaluation"]
    if section.saved:
        lines += ["", section.saved]
    if section.rows:
        lines += ["", "| task | kind | metrics | scored |", "|---|---|---|---|"]
        lines += [f"| {' | '.join(markdown_cell(cell) for cell in row)} |" for row in section.rows]
    if section.training:
        lines += ["", section.training]
    return lines + ["", *_plots_markdown(report, section.plots)]


def to_html(report: Report) -> str:
    esc = html.escape

    def image(name: str) -> str:
        if name not in report.plots:  # left out: the line that says why
            return f"<p class='left-out'>{esc(report.left_out.get(name, name + ': left out'))}</p>"
        data = base64.b64encode(report.plots[name].read_bytes()).decode()
        return f'<img alt="{esc(name)}" src="data:image/png;base64,{data}">'

    questions = _questions(report)
    summary = html_table([v.answer for v in questions], COLUMNS, words=WORDS, anchors=[v.key for v in questions])
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{esc(report.title)}</title>",
        "<style>body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;"
        "vertical-align:top}.badge{color:#fff;border-radius:4px;padding:1px 6px;font-size:90%}"
        "img{max-width:100%;display:block;margin:0.5em 0}li{margin:0.2em 0}.left-out{color:#666;font-style:italic}"
        "</style></head><body>",
        f"<h1>{esc(report.title)}</h1><table>",
        *[f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in report.facts],
        "</table><h2>Verdicts</h2>" + summary[0],
        *summary[1:],
    ]
    for verdict in report.verdicts:
        parts += html_section(verdict.answer, words=WORDS, anchor=verdict.key)
        parts += [image(p) for p in verdict.plots]
    section = report.evaluation
    if section is not None:
        parts.append("<h2 id='evaluation'>Evaluation</h2>")
        if section.saved:
            parts.append(f"<p>{esc(section.saved)}</p>")
        if section.rows:
            parts.append("<table><tr><th>task</th><th>kind</th><th>metrics</th><th>scored</th></tr>"
                         + "".join("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>"
                                   for row in section.rows) + "</table>")
        if section.training:
            parts.append(f"<p>{esc(section.training)}</p>")
        parts += [image(p) for p in section.plots]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def console_mode(report: Report, setting: str) -> str:
    """report.console as it applies to this run: short or full; auto is short for a run of under
    REPORT_FULL_AFTER_S (a run without a train record took no time worth a table)."""
    if setting != "auto":
        return setting
    return "full" if report.seconds is not None and report.seconds >= REPORT_FULL_AFTER_S else "short"


def render_console(report: Report, console: Any, setting: str = "full") -> None:
    """The review in the terminal as report.console says: the table (full), or the verdicts that
    are not ok, a line each (short)."""
    if console_mode(report, setting) == "full":
        render_summary(report, console)
    else:
        render_short(report, console)


def render_short(report: Report, console: Any) -> None:
    """One line per verdict that is not ok (warn, fail), then where the report is; a single line when
    every question is ok. An n/a is not a finding (a question this run cannot answer yet: too short
    to judge, no step timed) and is only counted, by name, in the first line."""
    questions = _questions(report)
    bad = [v for v in questions if v.status in (WARN, FAIL)]
    unjudged = [v.key.replace("_", " ") for v in questions if v.status == NA]
    where = f"report: {escape(str(report.html))}" if report.html is not None else ""
    if not bad and not unjudged:
        console.print(f"post-run review: all {len(questions)} questions ok" + (f"; {where}" if where else ""),
                      highlight=False, soft_wrap=True)  # soft: a path broken by the console is no path to copy
    else:
        counts = [f"{sum(v.status == s for v in questions)} {s.word}" for s in (FAIL, WARN, OK)
                  if any(v.status == s for v in questions)]
        if unjudged:
            counts.append(f"{len(unjudged)} n/a ({', '.join(unjudged)})")
        console.print(f"post-run review: {', '.join(counts)}" + (f"; {where}" if where else ""), highlight=False,
                      soft_wrap=True)
    render_lines(console, [v.answer for v in bad], words=WORDS, highlight=False, soft_wrap=True)
    if report.evaluation is not None:
        console.print(f"evaluation: {escape(report.evaluation.summary)}", highlight=False, soft_wrap=True)


def render_summary(report: Report, console: Any) -> None:
    """The verdicts as a short table in the terminal."""
    render_table(console, [v.answer for v in _questions(report)], COLUMNS, f"post-run review: {report.run_dir}",
                 words=WORDS, title_justify="left")
    if report.evaluation is not None:
        console.print(f"evaluation: {escape(report.evaluation.summary)}", highlight=False)
    if report.html is not None:
        console.print(f"report: {report.html} (plots inside), {report.markdown}")
