"""`llmtrain plan`'s output: a heading (the model, the devices), the table of layouts (one row per
kind: per-device memory by part, with and without activation checkpointing, the peak, whether it
fits, the communication per optimizer step and the pipeline bubble), footnotes (what the columns
count, the layouts the model cannot take and why, batch changes) and the recommendation with its
command."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from llmtrain.config.derived import seq_len_of
from llmtrain.core.console import default_console
from llmtrain.plan.build import Plan
from llmtrain.plan.cost import LayoutCost
from llmtrain.plan.layouts import PRESETS
from llmtrain.preflight.estimate import format_bytes

FITS_STYLE = {"yes": "green", "with ckpt": "green", "tight": "yellow", "no": "red"}


def fits_word(plan: Plan, c: LayoutCost) -> str:
    """yes (without checkpointing), with ckpt (only with it), tight (within the device, above the
    margin), no."""
    t = plan.target
    if c.plain.peak <= t.budget:
        return "yes"
    if c.checkpointed.peak <= t.budget:
        return "with ckpt"
    return "tight" if c.checkpointed.peak <= t.device_memory else "no"


def size(n: float) -> str:
    """Bytes in at most 8 characters, for the table: '949 MiB', '12.4 GiB', '1,234 GiB'."""
    if n >= 100 * 2**30:
        return f"{n / 2**30:,.0f} GiB"
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.0f} MiB"
    return f"{n / 2**10:.0f} KiB" if n >= 2**10 else f"{n:.0f} B"


# Narrower than this, the communication gets a table of its own under the memory table: the memory
# columns (about 115 characters) stay whole, and the collectives keep room to be read.
ONE_TABLE_WIDTH = 150


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 0, 0, 1))


def _layout_cell(plan: Plan, c: LayoutCost) -> str:
    chosen = plan.recommendation.rung
    marker = "-> " if chosen is not None and chosen.cost is c else ""
    return escape("\n".join([marker + c.layout.kind, c.layout.degrees_text]))


def _communication_cell(plan: Plan, c: LayoutCost) -> str:
    """The collectives of the variant the row stands for: with checkpointing when the recommendation
    uses it, or when only that fits; and a pipeline's bubble."""
    chosen = plan.recommendation.rung
    with_ckpt = chosen.checkpointing if chosen is not None and chosen.cost is c else fits_word(plan, c) == "with ckpt"
    lines = [f"{size(x.bytes)} {x.collective}: {x.what}" for x in c.transfers(with_ckpt)]
    if c.bubble is not None:
        lines.append(f"pipeline bubble {c.bubble:.0%} of a step")
    return escape("\n".join(lines) or "-")


def plan_tables(plan: Plan, width: int) -> list[Table]:
    """The layouts' table: memory per device and communication per step; below ONE_TABLE_WIDTH two
    tables, the communication under the memory."""
    t = plan.target
    devices = f"{t.devices} device{'s' if t.devices != 1 else ''}"
    together = width >= ONE_TABLE_WIDTH
    memory = _table(f"layouts of {devices}: memory per device" + (", communication per optimizer step"
                                                                  if together else ""))
    memory.add_column("layout", min_width=13, max_width=16)
    memory.add_column("micro-batch", justify="right", no_wrap=True)
    for name in ("weights", "gradients", "optimizer", "activations", "activations\nwith ckpt", "peak",
                 "peak\nwith ckpt"):
        memory.add_column(name, justify="right", no_wrap=True)
    memory.add_column("fits", no_wrap=True)
    if together:
        memory.add_column("communication / step", ratio=1, min_width=20)
    communication = _table(f"layouts of {devices}: communication per optimizer step")
    communication.add_column("layout", min_width=13, max_width=16)
    communication.add_column("communication / step")
    for c in plan.shown():
        plain, ckpt = c.plain, c.checkpointed
        fits = fits_word(plan, c)
        cells = [_layout_cell(plan, c), f"{c.batching.micro} x {c.batching.accumulation}",
                 *(size(n) for n in (plain.weights + plain.autocast_weights, plain.gradients, plain.optimizer,
                                     plain.working, ckpt.working, plain.peak, ckpt.peak)),
                 f"[{FITS_STYLE[fits]}]{fits}[/]"]
        memory.add_row(*cells, *([_communication_cell(plan, c)] if together else []))
        communication.add_row(_layout_cell(plan, c), _communication_cell(plan, c))
    return [memory] if together else [memory, communication]


def heading(plan: Plan) -> str:
    t, cfg = plan.target, plan.target.cfg
    return (f"[bold]llmtrain plan[/]: {escape(cfg.model.name)}, {t.shape.n_params:,} parameters, sequence "
            f"{seq_len_of(cfg):,}, global batch {cfg.global_batch_size}, {escape(cfg.optim.name.value)}; on "
            f"{escape(t.describe())}")


def footnotes(plan: Plan) -> list[str]:
    t = plan.target
    lines = [
        f"fits: the peak within {t.budget / t.device_memory:.0%} of a device ({format_bytes(t.budget)}), the margin "
        "for fragmentation and spikes `llmtrain check` keeps too; tight: within the device, above the margin",
        "weights: the fp32 parameters the device holds, with their compute-dtype copies (autocast's, FSDP's "
        "gathered blocks); activations: one micro-batch's, with the allocator's slack and the loss's logits; the "
        "peak adds the gradients held alongside" + (" and this process's own memory and data pages" if
                                                    t.runtime_bytes or t.data_bytes else ""),
        "micro-batch: sequences per data-parallel rank x micro-batches per step",
    ]
    if t.devices > 1:
        lines += [
            "layout degrees: replicate (whole copies), shard (fsdp), tp (tensor parallel), pp (pipeline stages)",
            "communication: bytes each device sends per optimizer step over ring collectives; pipeline bubble: the "
            "share of a step its stages idle, (stages - 1) / (micro-batches + stages - 1)",
        ]
    mixed = sorted({c.layout.kind for c in plan.costs if sum(n > 1 for n in (
        c.layout.degrees.dp_replicate, c.layout.degrees.dp_shard, c.layout.degrees.tp, c.layout.degrees.pp)) > 1})
    if mixed:
        lines.append(f"{', '.join(mixed)}: of their splits the one with the fewest ways of the second degree that "
                     "fits is shown")
    changed = [c for c in plan.shown() if c.batching.changed]
    if changed:
        kinds = ", ".join(c.layout.kind for c in changed)
        lines.append(f"{kinds}: the global batch of {t.cfg.global_batch_size} does not split over their data-parallel "
                     "ranks; planned with the next one that does (global_batch_size="
                     + ", ".join(str(c.batching.global_batch) for c in changed) + ")")
    if "hsdp" in {c.layout.kind for c in plan.costs}:
        lines.append("hsdp: trainable (parallel=hsdp), never the recommendation: it keeps fsdp's all-gathers "
                     "inside each machine of several, and the plan does not know how many devices a machine has")
    pipelines = [kind for kind in ("pp", "fsdp+pp") if kind in {c.layout.kind for c in plan.costs}]
    if pipelines:
        presets = ", ".join(f"parallel={PRESETS[kind]}" for kind in pipelines)
        lines.append(f"{', '.join(pipelines)}: trainable ({presets}), never the recommendation: tensor parallel or "
                     "sharding splits the same memory without a pipeline's idle bubble on these devices")
    # The reasons depend on the degree, not on the kind: one line per degree and reason
    by_degree: dict[tuple[str, str], list[str]] = {}
    for skip in plan.skipped:
        by_degree.setdefault((skip.degree, skip.reason), []).append(skip.kind)
    for (degree, reason), kinds in by_degree.items():
        lines.append(f"not possible: {', '.join(kinds)}{f' with {degree}' if degree else ''}: {reason}")
    return lines


def render_plan(plan: Plan, console: Console | None = None) -> None:
    console = console or default_console()
    console.print(heading(plan), highlight=False)
    for table in plan_tables(plan, console.width):
        console.print(table)
    for line in footnotes(plan):  # wrapped lines keep the indent
        console.print(Padding(Text(line, style="dim"), (0, 0, 0, 2)))
    r = plan.recommendation
    label = "[bold green]recommended[/]" if r.fits else "[bold yellow]recommended, tight[/]" if r.rung else \
        "[bold red]no layout fits[/]"
    console.print(f"{label}: {escape(r.reason)}", highlight=False)
    if r.command:
        console.print(f"  {escape(r.command)}", highlight=False, soft_wrap=True)
    for line in r.alternatives:
        console.print(f"  {escape(line)}", highlight=False, soft_wrap=True)
    for line in saver_lines(plan):
        console.print(escape(line), highlight=False, soft_wrap=True)


def saver_lines(plan: Plan) -> list[str]:
    """What makes the config fit one device of the target (preflight/savers.py, as `llmtrain check`'s
    memory row lists them), cheapest first, each as the overrides that apply it; none when it fits."""
    if plan.one_device is None:
        return []
    peak, savers = plan.one_device
    t = plan.target
    head = (f"on one device the config needs {format_bytes(peak)}, above {format_bytes(t.budget)}; "
            + ("what makes it fit, cheapest first (preset=memory_saver applies the first):" if savers and savers[0].fits
               else "nothing makes it fit; the nearest:"))
    return [head, *(f"  {s.command}  peak {format_bytes(s.peak)}; {s.cost}" for s in savers)]
