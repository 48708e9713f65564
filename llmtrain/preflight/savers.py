"""What would make a run fit in memory: the savers, each as the overrides that apply it, its
predicted peak and its cost, cheapest first. `llmtrain check`'s memory row (items_resources.py),
`llmtrain plan` (plan/build.py) and the `memory_saver` preset (`apply_memory_saver`, which `llmtrain
train` runs before anything is built) all read them from here.

Every predicted peak is the one memory estimate (estimate.py `estimate_memory`) of the config with
the saver's overrides applied (`with_overrides`): no second formula.

The cost of each saver, as a rough step time relative to the config as given (used to order them):

    activation checkpointing   measured on CPU (docs/configuration.md, 4x128, context 256, batch 8):
                               full 1.28, op 1.14, full every 2 blocks 1.13, op every 2 blocks 1.08
    micro-batch + accumulation the same global batch in smaller pieces: smaller matmuls run at a
                               lower utilization; assumed (not measured) 3% per halving
    adamw8bit                  GPU: about the same step (assumed 1.02); CPU: the optimizer step alone
                               is 12-40x slower than fused AdamW's and the first step compiles ~30 s
                               (measured, docs/configuration.md): 1.5 assumed for a whole step
    adafactor                  about the same step time, but a different optimizer (other dynamics,
                               the learning rate to re-tune): ordered after every saver that keeps
                               the run's results
    qlora (a LoRA run)         the frozen base's block linears in 4-bit NF4: measured on CPU 1.6x
                               LoRA's step (each product dequantizes its weight; docs/finetuning.md),
                               assumed the same elsewhere; the adapters then train on a base with
                               quantization error, so it is ordered with Adafactor
    zero1 / fsdp over N        N devices of the same kind (CUDA only: CPU processes share the host's
                               memory, so more of them never fit where one does not); assumed 1.05 /
                               1.10 for the communication, ordered after every one-device saver

When no single saver fits, combinations are tried (checkpointing and/or a low-bit or factored
optimizer, with the largest micro-batch that then fits); their factors multiply.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

from llmtrain.config.derived import micro_batch_size_of, world_size_of
from llmtrain.config.finetune import torchao_installed
from llmtrain.config.hydra import DATA_PARALLEL_PRESETS
from llmtrain.config.schema import ActivationCheckpointing, Config, FinetuneMethod, OptimizerName, Precision
from llmtrain.config.validate import validate
from llmtrain.core.errors import UserError
from llmtrain.preflight.estimate import estimate_memory, format_bytes, model_shape

FULL, OP, NONE = ActivationCheckpointing.full, ActivationCheckpointing.op, ActivationCheckpointing.none
# (mode, every k, relative step time): measured on CPU, docs/configuration.md "Activation checkpointing"
CHECKPOINTING_COST = ((OP, 2, 1.08), (FULL, 2, 1.13), (OP, 1, 1.14), (FULL, 1, 1.28))
MICRO_BATCH_HALVING_COST = 0.03  # assumed: smaller matmuls, lower utilization
LOW_BIT_COST = {"cpu": 1.5}  # measured optimizer step 12-40x slower on CPU; a whole step assumed 1.5x
LOW_BIT_COST_ELSEWHERE = 1.02  # a GPU: the moments quantized in the same kernel, about free (assumed)
SHARDING_COST = {"zero1": 1.05, "fsdp": 1.10}  # assumed: the collectives per step
QLORA_COST = 1.6  # measured on CPU: 0.75 s a step against LoRA's 0.46 (8 x 512 Llama, docs/finetuning.md)
SHARDING_DEVICES = 8  # devices tried for sharding: one machine's usual count (more where this one has more)


@dataclass(frozen=True)
class EstimateBasis:
    """What the memory estimate needs besides the config: the model's vocabulary, the device and
    precision, the process's own memory and the data's pages (host only), and how many devices a
    sharding saver may spread over (0: none, e.g. on a CPU)."""

    vocab_size: int
    device_type: str
    precision: Precision
    runtime_bytes: float = 0.0
    data_bytes: float = 0.0
    max_devices: int = 0

    @classmethod
    def of_facts(cls, facts) -> EstimateBasis:  # facts: preflight.facts.Facts (imported there, not here)
        import torch

        gpus = torch.cuda.device_count() if facts.device.type == "cuda" else 0
        return cls(facts.vocab_size, facts.device.type, facts.precision, facts.memory.runtime, facts.memory.data,
                   max(SHARDING_DEVICES, gpus) if facts.device.type == "cuda" else 0)


@dataclass(frozen=True)
class Saver:
    """One way to fit: the overrides that apply it (key -> value, as typed on the command line), the
    predicted peak of the config with them, whether that fits, the cost in words and as a rough
    relative step time."""

    overrides: dict[str, str]
    peak: float
    fits: bool
    factor: float
    cost: str
    devices: int = 1  # > 1: a sharding saver over this many devices
    # Adafactor: other dynamics, the LR to re-tune; QLoRA: adapters trained on a base with quantization error
    changes_results: bool = False

    @property
    def command(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.overrides.items())

    def describe(self) -> str:
        return f"{self.command} (peak {format_bytes(self.peak)}; {self.cost})"

    @property
    def order(self) -> tuple:
        return (not self.fits, self.devices > 1, self.changes_results, self.factor, self.peak)


@dataclass(frozen=True)
class _Part:
    overrides: dict[str, str]
    factor: float
    cost: str  # in words, without the factor
    devices: int = 1
    changes_results: bool = False


def with_overrides(cfg: Config, overrides: dict[str, str]) -> Config:
    """A copy of `cfg` with a saver's overrides applied as `llmtrain train ... KEY=VALUE` would:
    `optim=NAME` and `parallel=NAME` switch the group (the keys its option file sets; the optimizer's
    own settings kept, except Adafactor's weight decay of 0, its option's), the others set the key."""
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        if key == "optim":
            _switch_optimizer(out, OptimizerName(value))
        elif key == "parallel":
            for name, setting in DATA_PARALLEL_PRESETS[value].items():  # from a one-process config
                setattr(out.parallel, name, setting)
        elif key == "micro_batch_size":
            out.micro_batch_size = int(value)  # assigned after validation: explicit, as from the command line
        elif key == "parallel.nproc":
            out.parallel.nproc = int(value)
        elif key == "model.activation_checkpointing":
            out.model.activation_checkpointing = ActivationCheckpointing(value)
        elif key == "model.checkpoint_every":
            out.model.checkpoint_every = int(value)
        elif key == "finetune.method":
            out.finetune.method = FinetuneMethod(value)
        else:
            raise ValueError(f"not a saver's key: {key}")
    return out


def _switch_optimizer(cfg: Config, name: OptimizerName) -> None:
    if name is OptimizerName.adafactor and cfg.optim.weight_decay == 0.1:  # adam(w)'s option value: adafactor's is 0
        cfg.optim.weight_decay = 0.0
    if name in (OptimizerName.adamw8bit, OptimizerName.adamw4bit):
        cfg.optim.fused = None  # torchao compiles its own step (its option file sets null)
    cfg.optim.name = name


def predicted_peak(cfg: Config, basis: EstimateBasis, overrides: dict[str, str] | None = None) -> float:
    """The estimate's peak of `cfg` with `overrides` applied: one process as the config runs it alone
    (the memory row's figure), or one rank of a sharding saver's processes."""
    overrides = overrides or {}
    alt = with_overrides(cfg, overrides)
    layout = overrides.get("parallel", "single")
    world = int(overrides.get("parallel.nproc", 1))
    return estimate_memory(alt, model_shape(alt, basis.vocab_size), basis.vocab_size, basis.device_type,
                           basis.precision, layout, world, runtime_bytes=basis.runtime_bytes,
                           data_bytes=basis.data_bytes).peak


def _valid(cfg: Config, overrides: dict[str, str]) -> bool:
    """Whether `llmtrain train` would take the config with these overrides (a low-bit optimizer under
    tensor or pipeline parallel, or without torchao, is refused there, so not offered here)."""
    try:
        validate(with_overrides(cfg, overrides))
    except UserError:
        return False
    return True


def _checkpointing_parts(cfg: Config) -> list[_Part]:
    """The checkpointing modes that keep less than the config's own (checkpointing every block
    saves more than every other one; full more than op)."""
    m = cfg.model
    rank = {(NONE, 1): 0, (OP, 2): 1, (FULL, 2): 2, (OP, 1): 3, (FULL, 1): 4}
    current = rank.get((m.activation_checkpointing, m.checkpoint_every if m.activation_checkpointing is not NONE
                        else 1), 1)
    parts = []
    for mode, every, factor in CHECKPOINTING_COST:
        if rank[(mode, every)] <= current:
            continue
        overrides = {"model.activation_checkpointing": mode.value}
        if every != m.checkpoint_every:
            overrides["model.checkpoint_every"] = str(every)
        what = "recomputes each block in backward" if mode is FULL else "recomputes the elementwise ops in backward"
        where = "" if every == 1 else " of every other block"
        parts.append(_Part(overrides, factor, f"{what}{where}"))
    return parts


def _optimizer_parts(cfg: Config, basis: EstimateBasis) -> list[_Part]:
    """8-bit AdamW (AdamW only, where torchao is installed and the layout takes it) and Adafactor
    (for Adam/AdamW: their state is what it shrinks)."""
    parts = []
    if cfg.optim.name is OptimizerName.adamw and torchao_installed():
        overrides = {"optim": OptimizerName.adamw8bit.value}
        if _valid(cfg, overrides):
            factor = LOW_BIT_COST.get(basis.device_type, LOW_BIT_COST_ELSEWHERE)
            words = ("the same AdamW, its moments in 8 bits; on a CPU its optimizer step is 12-40x slower and the "
                     "first step compiles for ~30 s" if basis.device_type == "cpu" else
                     "the same AdamW, its moments in 8 bits: about the same step")
            parts.append(_Part(overrides, factor, words))
    if cfg.optim.name in (OptimizerName.adamw, OptimizerName.adam):
        parts.append(_Part({"optim": OptimizerName.adafactor.value}, 1.0,
                           "a different optimizer (factored state): other dynamics, re-tune the learning rate "
                           "(null: 1e-2)", changes_results=True))
    return parts


def _finetune_parts(cfg: Config) -> list[_Part]:
    """QLoRA for a LoRA run, where torchao is installed and the run can take it (one process, a
    folder's weights, a width NF4's blocks of 64 fit): `finetune.method=qlora` keeps the run's
    adapter settings."""
    if cfg.finetune.method != FinetuneMethod.lora or not torchao_installed():
        return []
    overrides = {"finetune.method": FinetuneMethod.qlora.value}
    if not _valid(cfg, overrides):
        return []
    return [_Part(overrides, QLORA_COST, "the frozen base's block linears in 4-bit NF4 (~0.52 bytes a weight against "
                  "4): each product dequantizes its weight, and the adapters train on the quantized base",
                  changes_results=True)]


def _combine(parts: Sequence[_Part]) -> _Part:
    overrides: dict[str, str] = {}
    for part in parts:
        overrides.update(part.overrides)
    return _Part(overrides, math.prod(p.factor for p in parts), "; ".join(p.cost for p in parts),
                 max((p.devices for p in parts), default=1), any(p.changes_results for p in parts))


def _saver(cfg: Config, basis: EstimateBasis, budget: float, part: _Part) -> Saver:
    peak = predicted_peak(cfg, basis, part.overrides)
    cost = f"~{part.factor:.2f}x step time: {part.cost}"
    return Saver(part.overrides, peak, peak <= budget, part.factor, cost, part.devices, part.changes_results)


def _with_smaller_micro(cfg: Config, basis: EstimateBasis, budget: float, part: _Part | None) -> Saver | None:
    """`part` (or nothing) with the largest micro-batch below the config's that divides the global
    batch and then fits; the smallest one, not fitting, when none does; None when there is none."""
    world = world_size_of(cfg)
    micro, per_rank = micro_batch_size_of(cfg, world), cfg.global_batch_size // world
    smaller = sorted((m for m in range(1, micro) if per_rank % m == 0), reverse=True)
    if not smaller:
        return None
    base = part.overrides if part else {}
    found = None
    for m in smaller:
        found = m
        if predicted_peak(cfg, basis, {**base, "micro_batch_size": str(m)}) <= budget:
            break
    accum = per_rank // found
    halvings = math.log2(micro / found)
    factor = 1 + MICRO_BATCH_HALVING_COST * halvings
    own = _Part({"micro_batch_size": str(found)}, factor,
                f"accumulation {accum} keeps the global batch {cfg.global_batch_size}, in smaller matmuls")
    return _saver(cfg, basis, budget, _combine([p for p in (part, own) if p is not None]))


def _sharding_savers(cfg: Config, basis: EstimateBasis, budget: float) -> list[Saver]:
    """ZeRO-1 and FSDP over the fewest devices (2, 4, 8, ... up to basis.max_devices) on which one
    rank fits; the most devices, not fitting, when none do. Only for a one-process config."""
    if basis.max_devices < 2 or world_size_of(cfg) != 1:
        return []
    out = []
    for kind, factor in SHARDING_COST.items():
        found = None
        n = 2
        while n <= basis.max_devices:
            overrides = {"parallel": kind, "parallel.nproc": str(n)}
            if cfg.micro_batch_size is not None and cfg.micro_batch_size * n > cfg.global_batch_size:
                if cfg.global_batch_size % n:
                    break
                overrides["micro_batch_size"] = str(cfg.global_batch_size // n)  # each rank's share of the batch
            if _valid(cfg, overrides):
                split = "the optimizer state" if kind == "zero1" else "weights, gradients and optimizer state"
                found = _saver(cfg, basis, budget, _Part(overrides, factor, f"{n} devices: {split} split over them, "
                                                         "collectives every step", devices=n))
                if found.fits:
                    break
            n *= 2
        if found is not None:
            out.append(found)
    return out


def memory_savers(cfg: Config, basis: EstimateBasis, budget: float) -> list[Saver]:
    """The savers that bring the predicted peak within `budget`, cheapest first (one device before
    several, those that keep the run's results before those that change them, then by step time);
    when none does, the one that comes nearest. Combinations only when no single saver fits."""
    # what the weights and the optimizer's state are stored as: one of these at a time
    ckpt, optim = _checkpointing_parts(cfg), _optimizer_parts(cfg, basis) + _finetune_parts(cfg)
    singles = [_saver(cfg, basis, budget, part) for part in ckpt + optim]
    if (micro := _with_smaller_micro(cfg, basis, budget, None)) is not None:
        singles.append(micro)
    singles += _sharding_savers(cfg, basis, budget)
    fitting = [s for s in singles if s.fits]
    tried = list(singles)
    if not fitting:
        combos = []
        for c in [None, *ckpt]:
            for o in [None, *optim]:
                chosen = [p for p in (c, o) if p is not None]
                if len(chosen) == 2:
                    combos.append(_saver(cfg, basis, budget, _combine(chosen)))
                if chosen and (smaller := _with_smaller_micro(cfg, basis, budget, _combine(chosen))) is not None:
                    combos.append(smaller)
        fitting = [s for s in combos if s.fits]
        tried += combos
    if fitting:
        return sorted(fitting, key=lambda s: s.order)
    return [min(tried, key=lambda s: s.peak)] if tried else []


def applicable_here(saver: Saver, basis: EstimateBasis) -> bool:
    """Whether `llmtrain train` can apply the saver on this machine: sharding needs its devices here."""
    import torch

    return saver.devices == 1 or (basis.device_type == "cuda" and saver.devices <= torch.cuda.device_count())


def apply_memory_saver(cfg: Config, facts=None) -> tuple[Config, str | None, dict[str, str]]:
    """The `memory_saver` preset: when the predicted peak is above the memory row's margin, the
    config with the cheapest saver that fits (and that this machine can run) applied, the one line
    that says which and why, and the overrides applied (for the resume command). A config that
    fits, or one nothing makes fit, comes back unchanged (the latter for the check to refuse)."""
    if not cfg.memory_saver:
        return cfg, None, {}
    from llmtrain.preflight.facts import MEMORY_WARN_FRACTION, gather_facts

    facts = facts or gather_facts(cfg, measure_compute=False)
    budget = facts.memory_budget * MEMORY_WARN_FRACTION
    peak = facts.memory.peak
    if peak <= budget:
        return cfg, (f"memory_saver: the predicted peak {format_bytes(peak)} fits {format_bytes(budget)} "
                     f"({MEMORY_WARN_FRACTION:.0%} of {format_bytes(facts.memory_budget)} {facts.memory_source}): "
                     "nothing changed"), {}
    basis = EstimateBasis.of_facts(facts)
    chosen = next((s for s in memory_savers(cfg, basis, budget) if s.fits and applicable_here(s, basis)), None)
    if chosen is None:
        return cfg, (f"memory_saver: nothing this machine can apply brings the predicted peak {format_bytes(peak)} "
                     f"within {format_bytes(budget)}"), {}
    applied = with_overrides(cfg, chosen.overrides)
    line = (f"memory_saver: applied {chosen.command}: predicted peak {format_bytes(peak)} -> "
            f"{format_bytes(chosen.peak)}, within {format_bytes(budget)} ({MEMORY_WARN_FRACTION:.0%} of "
            f"{format_bytes(facts.memory_budget)} {facts.memory_source}); cost: {chosen.cost}")
    return applied, line, dict(chosen.overrides)
