"""A whole plan for a config: the target, every layout's cost, the impossible layouts and the
recommendation (what render.py prints and tests read)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmtrain.config.schema import Config
from llmtrain.plan.cost import LayoutCost
from llmtrain.plan.layouts import KINDS, Skipped
from llmtrain.plan.recommend import Recommendation, plan_costs, recommend
from llmtrain.plan.target import Target, resolve_target
from llmtrain.preflight.savers import SHARDING_DEVICES, EstimateBasis, Saver, memory_savers, predicted_peak


@dataclass(frozen=True)
class Plan:
    target: Target
    costs: tuple[LayoutCost, ...]  # every possible layout, in the order of layouts.KINDS
    skipped: tuple[Skipped, ...]
    recommendation: Recommendation
    # what makes the config fit one device of the target, when it does not as given (preflight/savers.py:
    # the check's memory row lists the same); (config's peak on one device, the savers)
    one_device: tuple[float, tuple[Saver, ...]] | None = None

    def shown(self) -> list[LayoutCost]:
        """One layout per kind for the table: of a mix's degrees (hsdp, fsdp+tp, fsdp+pp), the
        first (fewest ways of the second degree) that fits, else the first that fits with
        activation checkpointing, else the leanest; the recommended one wherever it is."""
        chosen = self.recommendation.rung.cost if self.recommendation.rung else None
        out = []
        for kind in KINDS:
            of_kind = [c for c in self.costs if c.layout.kind == kind]
            if not of_kind:
                continue
            if any(c is chosen for c in of_kind):
                out.append(chosen)
                continue
            budget = self.target.budget
            out.append(next((c for c in of_kind if c.plain.peak <= budget), None)
                       or next((c for c in of_kind if c.checkpointed.peak <= budget), None)
                       or min(of_kind, key=lambda c: c.checkpointed.peak))
        return out

    @property
    def exit_code(self) -> int:
        """0: a layout fits within the margin; 1: only a tight one, or none."""
        return 0 if self.recommendation.fits else 1


def make_plan(target: Target, overrides: Sequence[str] = (), config_dir: str | None = None) -> Plan:
    costs, skipped = plan_costs(target)
    return Plan(target, tuple(costs), tuple(skipped), recommend(target, costs, overrides, config_dir),
                one_device_savers(target))


def one_device_savers(target: Target) -> tuple[float, tuple[Saver, ...]] | None:
    """The config's peak on one device of the target and the savers that would make it fit there, as
    the check's memory row gives them; None when it fits as given."""
    basis = EstimateBasis(target.vocab_size, target.device_type, target.precision, target.runtime_bytes,
                          target.data_bytes, max(SHARDING_DEVICES, target.devices) if target.device_type == "cuda"
                          else 0)
    peak = predicted_peak(target.cfg, basis)
    if peak <= target.budget:
        return None
    return peak, tuple(memory_savers(target.cfg, basis, target.budget))


def plan_config(cfg: Config, devices: int | None = None, device_memory: float | None = None,
                overrides: Sequence[str] = (), config_dir: str | None = None) -> Plan:
    """The plan for `cfg` on `devices` devices of `device_memory` bytes (defaults: this machine's)."""
    return make_plan(resolve_target(cfg, devices, device_memory), overrides, config_dir)
