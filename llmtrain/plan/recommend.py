"""The recommendation: the smallest change from plain data parallelism that fits, why, and the
command that trains it.

The ladder, cheapest change first (only layouts `llmtrain train` runs are on it, and of those not
hsdp: it keeps fsdp's all-gathers inside a machine when there are several, and the plan does not know
how many devices a machine has; its row shows what it would take):

    1. data parallel: ddp (one device: the plain run), zero1, fsdp    more communication, no more compute
    2. the same with activation checkpointing                         a third more compute, none more traffic
    3. tensor parallel, fsdp+tp (fewest ways first), then with        an all-reduce of activations four times a
       activation checkpointing                                       layer: within one machine's fast links

The first rung whose peak fits within the margin (Target.budget) is recommended, unless it
recomputes or splits layers (2 or 3) where a data-parallel rung without checkpointing fits at a
smaller micro-batch (accumulation keeping the global batch): the same maths for a few percent of
step time in smaller matmuls, against a third more compute or an all-reduce per layer (the order
preflight/savers.py gives `llmtrain check`'s memory row too); the chosen rung is then the
alternative. With nothing within the margin, the first that fits with a smaller micro-batch; then
the first within a device's whole memory, marked tight; with nothing at all, the device count that
would fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from llmtrain.config.schema import ActivationCheckpointing
from llmtrain.plan.cost import LayoutCost, cost
from llmtrain.plan.layouts import PRESETS, enumerate_layouts
from llmtrain.plan.target import Target
from llmtrain.preflight.estimate import format_bytes
from llmtrain.preflight.render import rerun_command_line

DATA_PARALLEL = ("single", "ddp", "zero1", "fsdp")
TENSOR_PARALLEL = ("tp", "fsdp+tp")
# The next lever after each rung, for the headroom sentence ("... not needed until ...").
NEXT_LEVER = {"single": "activation checkpointing", "ddp": "sharding (zero1, fsdp)", "zero1": "fsdp",
              "fsdp": "activation checkpointing"}
LARGEST_MICRO = 65536  # the headroom search stops here: "fits any micro-batch"
MORE_DEVICES_UP_TO = 16384


@dataclass(frozen=True)
class Rung:
    """A layout with activation checkpointing on or off: one step of the ladder; `smaller_micro`
    when its cost is at a micro-batch below the config's (accumulation keeping the global batch)."""

    cost: LayoutCost
    checkpointing: bool
    smaller_micro: bool = False

    @property
    def peak(self) -> float:
        return self.cost.memory(self.checkpointing).peak

    @property
    def label(self) -> str:
        return (self.cost.layout.kind + (" with activation checkpointing" if self.checkpointing else "")
                + (f" at micro_batch_size={self.cost.batching.micro}" if self.smaller_micro else ""))


@dataclass(frozen=True)
class Recommendation:
    rung: Rung | None  # None: nothing trainable fits
    fits: bool  # within the margin (False: tight, or nothing)
    reason: str
    command: str | None
    alternatives: tuple[str, ...] = ()  # other ways, a sentence each


def plan_costs(target: Target) -> tuple[list[LayoutCost], list]:
    """Every layout of the target's devices with its cost, and the impossible ones (layouts.Skipped)."""
    layouts, skipped = enumerate_layouts(target.devices, target.cfg, target.vocab_size)
    return [cost(target, layout) for layout in layouts], skipped


def ladder(costs: Sequence[LayoutCost]) -> list[Rung]:
    """The trainable layouts in the order of the module's ladder."""
    data = [c for c in costs if c.layout.kind in DATA_PARALLEL]
    tensor = sorted((c for c in costs if c.layout.kind in TENSOR_PARALLEL), key=lambda c: c.layout.degrees.tp)
    return ([Rung(c, False) for c in data] + [Rung(c, True) for c in data]
            + [Rung(c, False) for c in tensor] + [Rung(c, True) for c in tensor])


def first_fit(rungs: Sequence[Rung], budget: float) -> Rung | None:
    return next((rung for rung in rungs if rung.peak <= budget), None)


def recommend(target: Target, costs: Sequence[LayoutCost], overrides: Sequence[str] = (),
              config_dir: str | None = None) -> Recommendation:
    """The first rung that fits within the margin at the config's micro-batch; else the first that
    does at a smaller one; else the first within a device's whole memory (tight); else none, with
    the device count that would fit."""
    rungs = ladder(costs)
    if (chosen := first_fit(rungs, target.budget)) is not None:
        smaller = _cheaper_at_a_smaller_micro_batch(target, rungs, chosen)
        if smaller is not None:
            return _smaller_instead(target, rungs, chosen, smaller, overrides, config_dir)
        return _recommendation(target, rungs, chosen, True, overrides, config_dir)
    if (smaller := smaller_micro_batch(target, rungs)) is not None:
        leanest = min(rungs, key=lambda rung: rung.peak)
        reason = (f"{smaller.label}: {_fit_text(target, smaller)}; at the micro-batch the config gives nothing fits "
                  f"(the leanest, {leanest.label}, needs {format_bytes(leanest.peak)} at "
                  f"{leanest.cost.batching.micro} sequences), and accumulation of "
                  f"{smaller.cost.batching.accumulation} micro-batches keeps the global batch.")
        return Recommendation(smaller, True, reason, train_command(target, smaller, overrides, config_dir),
                              tuple(_more_devices(target)))
    if (chosen := first_fit(rungs, target.device_memory)) is not None:
        return _recommendation(target, rungs, chosen, False, overrides, config_dir)
    leanest = min(rungs, key=lambda rung: rung.peak)
    reason = (f"nothing llmtrain trains fits {target.devices} device{'s' if target.devices > 1 else ''} of "
              f"{format_bytes(target.device_memory)}, not even with a micro-batch of 1: the leanest, {leanest.label}, "
              f"needs {format_bytes(leanest.peak)} per device.")
    return Recommendation(None, False, reason, None, tuple(_more_devices(target)))


def _recommendation(target: Target, rungs: Sequence[Rung], chosen: Rung, fits: bool, overrides: Sequence[str],
                    config_dir: str | None) -> Recommendation:
    at = rungs.index(chosen)
    sentences = [f"{chosen.label}: {_fit_text(target, chosen)}"]
    if not fits:
        sentences.append(f"tight: {chosen.peak / target.device_memory:.0%} of a device, above the "
                         f"{target.budget / target.device_memory:.0%} that leaves room for fragmentation and spikes")
    if at:
        sentences.append(_simpler_ones(rungs[:at]))
    if fits:
        sentences.append(_headroom(target, chosen))
    if chosen.cost.batching.changed:
        sentences.append(_batch_change(target, chosen.cost))
    alternatives = []
    if chosen.checkpointing or chosen.cost.layout.kind in TENSOR_PARALLEL:
        # tight: activations are what does not fit, and a smaller micro-batch may do with a simpler layout
        if (smaller := smaller_micro_batch(target, rungs[:at])) is not None:
            alternatives.append(f"or {smaller.label} ({format_bytes(smaller.peak)} per device; accumulation "
                                f"{smaller.cost.batching.accumulation} keeps the global batch): "
                                f"{train_command(target, smaller, overrides, config_dir)}")
    command = train_command(target, chosen, overrides, config_dir)
    return Recommendation(chosen, fits, "; ".join(sentences) + ".", command, tuple(alternatives))


def _cheaper_at_a_smaller_micro_batch(target: Target, rungs: Sequence[Rung], chosen: Rung) -> Rung | None:
    """Where `chosen` recomputes (activation checkpointing) or splits layers (tensor parallel): the
    first data-parallel rung below it without checkpointing that fits at a smaller micro-batch."""
    if not (chosen.checkpointing or chosen.cost.layout.kind in TENSOR_PARALLEL):
        return None
    plain = [rung for rung in rungs[:rungs.index(chosen)] if not rung.checkpointing]
    return smaller_micro_batch(target, plain)


def _smaller_instead(target: Target, rungs: Sequence[Rung], chosen: Rung, smaller: Rung, overrides: Sequence[str],
                     config_dir: str | None) -> Recommendation:
    b = smaller.cost.batching
    as_given = next(r for r in rungs if r.cost.layout == smaller.cost.layout and not r.checkpointing)
    cost_of_chosen = "a third more compute" if chosen.checkpointing else "an all-reduce of activations per layer"
    reason = (f"{smaller.label}: {_fit_text(target, smaller)}; at the micro-batch the config gives it needs "
              f"{format_bytes(as_given.peak)}, and accumulation of {b.accumulation} micro-batches keeps the global "
              f"batch, for a few percent of step time where {chosen.label} would cost {cost_of_chosen}.")
    alternative = (f"or {chosen.label} at the micro-batch the config gives ({format_bytes(chosen.peak)} per device): "
                   f"{train_command(target, chosen, overrides, config_dir)}")
    return Recommendation(smaller, True, reason, train_command(target, smaller, overrides, config_dir),
                          (alternative,))


def _fit_text(target: Target, rung: Rung) -> str:
    if target.devices == 1:
        return f"a {format_bytes(rung.peak)} peak fits in {format_bytes(target.device_memory)}"
    return (f"{target.devices} x {format_bytes(rung.peak)} peak fits in {format_bytes(target.device_memory)} "
            f"per device")


def _simpler_ones(earlier: Sequence[Rung]) -> str:
    """What the rungs below the chosen one need: the data-parallel ones without checkpointing, and
    the one just below."""
    shown = [rung for rung in earlier if not rung.checkpointing and rung.cost.layout.kind in DATA_PARALLEL]
    if earlier[-1] not in shown:
        shown.append(earlier[-1])
    return "it does not fit with " + ", ".join(f"{rung.label} ({format_bytes(rung.peak)})" for rung in shown)


def _headroom(target: Target, rung: Rung) -> str:
    """How far the chosen rung stretches: the largest micro-batch it still fits, as the point where
    the next lever would be needed."""
    kind = rung.cost.layout.kind
    if not rung.checkpointing:
        lever = NEXT_LEVER.get(kind, "activation checkpointing")
    else:  # one device has no tensor parallelism to turn to
        lever = "tensor parallelism" if kind in DATA_PARALLEL and kind != "single" else "more devices"
    micro = rung.cost.batching.micro

    def fits(m: int) -> bool:
        return cost(target, rung.cost.layout, m).memory(rung.checkpointing).peak <= target.budget

    low, high = micro, micro * 2
    while high <= LARGEST_MICRO and fits(high):
        low, high = high, high * 2
    if high > LARGEST_MICRO:
        return f"{lever} not needed for any micro-batch up to {LARGEST_MICRO:,} sequences"
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return (f"{lever} not needed until the micro-batch passes {low:,} sequence{'s' if low != 1 else ''} per device "
            f"(it is {micro})")


def _batch_change(target: Target, c: LayoutCost) -> str:
    b = c.batching
    return (f"the global batch of {target.cfg.global_batch_size} does not split over its "
            f"{c.layout.degrees.data_parallel} data-parallel ranks (micro-batch {b.micro}), so the command sets "
            f"global_batch_size={b.global_batch}: check the learning rate for the larger batch")


def smaller_micro_batch(target: Target, rungs: Sequence[Rung]) -> Rung | None:
    """The first of `rungs` that fits within the margin at a smaller micro-batch (one dividing its
    rank's share of the global batch, the largest that fits), accumulation keeping the global batch."""
    for rung in rungs:
        b = rung.cost.batching
        per_rank = b.global_batch // rung.cost.layout.degrees.data_parallel
        for micro in sorted((m for m in range(1, b.micro) if per_rank % m == 0), reverse=True):
            smaller = Rung(cost(target, rung.cost.layout, micro), rung.checkpointing, smaller_micro=True)
            if smaller.peak <= target.budget:
                return smaller
    return None


def _more_devices(target: Target) -> list[str]:
    """The smallest device count (doubling) on which a layout fits at the config's micro-batch. Not
    for CPU processes: more of them share the same host memory."""
    if target.device_type == "cpu":
        return []
    n = target.devices * 2
    while n <= MORE_DEVICES_UP_TO:
        more = dataclasses.replace(target, devices=n)
        found = first_fit(ladder(plan_costs(more)[0]), more.budget)
        if found is not None:
            return [f"or {n} devices: {found.label}, {format_bytes(found.peak)} per device "
                    f"(`llmtrain plan ... --devices {n}` shows the table)"]
        n *= 2
    return []


def train_command(target: Target, rung: Rung, overrides: Sequence[str], config_dir: str | None) -> str:
    """`llmtrain train` with the overrides the plan was made for and the layout's keys: its preset
    (conf/parallel/), the process count and the degrees the preset leaves open (the command line's
    own parallel keys dropped: the plan decides them), activation checkpointing where it differs
    from the config, a global batch that splits, and a smaller micro-batch where one was chosen (a
    null micro_batch_size is derived per data-parallel rank, as the plan derives it)."""
    c, cfg = rung.cost, target.cfg
    d, kind = c.layout.degrees, c.layout.kind
    changes: dict[str, str] = {}
    if kind in PRESETS:
        changes["parallel"] = PRESETS[kind]
        changes["parallel.nproc"] = str(d.devices)
    if kind == "hsdp":
        changes["parallel.dp_replicate"] = str(d.dp_replicate)
    if kind == "fsdp+tp":
        changes["parallel.dp_shard"] = str(d.dp_shard)
    if kind in ("pp", "fsdp+pp"):  # the stages, and the window's micro-batches the plan counted (the presets have 4)
        changes["parallel.pp"] = str(d.pp)
        changes["parallel.pp_microbatches"] = str(c.batching.accumulation)
    if d.tp > 1:
        changes["parallel.tp"] = str(d.tp)
        if d.sequence_parallel != (kind == "fsdp+tp"):  # the fsdp_tp preset has it on, the tp one off
            changes["parallel.sequence_parallel"] = str(d.sequence_parallel).lower()
    # A rung's checkpointing is full on every block (its memory was estimated so), or none.
    mode = ActivationCheckpointing.full if rung.checkpointing else ActivationCheckpointing.none
    if mode is not cfg.model.activation_checkpointing:
        changes["model.activation_checkpointing"] = mode.value
    if rung.checkpointing and cfg.model.checkpoint_every != 1:
        changes["model.checkpoint_every"] = "1"
    if c.batching.changed:
        changes["global_batch_size"] = str(c.batching.global_batch)
    if rung.smaller_micro:
        changes["micro_batch_size"] = str(c.batching.micro)
    kept = [o for o in overrides if not o.lstrip("+~").startswith(("parallel.", "parallel="))]
    return rerun_command_line(kept, config_dir, changes)
