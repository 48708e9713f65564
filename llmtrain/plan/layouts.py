"""The layouts of N devices: every way the degrees (data-parallel replicas and shards, tensor- and
pipeline-parallel ways) multiply to N, in kinds, and those the model cannot take, each with why (for
tensor parallelism the refusals `llmtrain train` itself gives: config/parallel_limits.py).

    single     one device
    ddp        dp_replicate=N: every device a whole copy, gradients all-reduced
    zero1      ddp with the optimizer state sharded over the N ranks
    fsdp       dp_shard=N: weights, gradients and optimizer state sharded, blocks gathered in turn
    hsdp       dp_replicate x dp_shard: fsdp within groups, replicated across them
    tp         tp=N: each block's heads and MLP units split N ways
    fsdp+tp    dp_shard x tp
    pp         pp=N: the blocks in N consecutive stages
    fsdp+pp    dp_shard x pp
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.config.derived import seq_len_of
from llmtrain.config.parallel_limits import tensor_parallel_problems
from llmtrain.config.schema import Config
from llmtrain.preflight.estimate import LayoutDegrees, layout_name

KINDS = ("single", "ddp", "zero1", "fsdp", "hsdp", "tp", "fsdp+tp", "pp", "fsdp+pp")
# Every kind but `single` has its `llmtrain train` preset (conf/parallel/<preset>.yaml).
PRESETS = {"ddp": "ddp", "zero1": "zero1", "fsdp": "fsdp", "hsdp": "hsdp", "tp": "tp", "fsdp+tp": "fsdp_tp",
           "pp": "pp", "fsdp+pp": "fsdp_pp"}


@dataclass(frozen=True)
class Layout:
    degrees: LayoutDegrees

    @property
    def kind(self) -> str:
        return layout_name(self.degrees)

    @property
    def degrees_text(self) -> str:
        """'replicate 8', 'shard 4 x tp 2', 'replicate 2 x shard 4', 'pp 8'; '+ seq' for sequence parallelism."""
        d = self.degrees
        parts = [f"{name} {n}" for name, n in (("replicate", d.dp_replicate), ("shard", d.dp_shard), ("tp", d.tp),
                                               ("pp", d.pp)) if n > 1]
        return " x ".join(parts) + (" + seq" if d.sequence_parallel else "") if parts else "1 device"


@dataclass(frozen=True)
class Skipped:
    """A layout the model cannot take: `kind` with `degree` (e.g. 'tp 8') and the reason (sentences)."""

    kind: str
    degree: str
    reason: str


def divisors(n: int) -> list[int]:
    """The divisors of n strictly between 1 and n, ascending."""
    small = [d for d in range(2, int(n**0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)} - {1, n})


def tp_refusal(cfg: Config, vocab_size: int, tp: int) -> str | None:
    """Why the model cannot split `tp` ways (None: it can), in `llmtrain train`'s own words: whole
    heads and key/value heads per process, equal slices of the MLP and of the vocabulary, no dropout,
    an optimizer that steps split weights."""
    problems = tensor_parallel_problems(cfg.model, vocab_size, tp, sequence_parallel=False, seq_len=None,
                                        optimizer=cfg.optim.name)
    return " ".join(problems) or None


def pp_refusal(cfg: Config, pp: int) -> str | None:
    """Why the blocks cannot make `pp` stages (None: they can; uneven stages are allowed)."""
    layers = cfg.model.n_layer
    return f"{pp} stages are more than the model's {layers} layers" if pp > layers else None


def tensor_degrees(cfg: Config, **degrees: int) -> LayoutDegrees:
    """Degrees with tensor parallelism, and sequence parallelism wherever the sequence splits evenly
    over the tensor-parallel processes: it saves the norms' and residual activations at the same
    traffic (a reduce-scatter and an all-gather in place of each all-reduce)."""
    tp = degrees.get("tp", 1)
    return LayoutDegrees(**degrees, sequence_parallel=tp > 1 and seq_len_of(cfg) % tp == 0)


def enumerate_layouts(devices: int, cfg: Config, vocab_size: int) -> tuple[list[Layout], list[Skipped]]:
    """Every layout of `devices` devices, in the order of KINDS (mixes by their second degree,
    ascending), and the ones the model cannot take."""
    if devices == 1:
        return [Layout(LayoutDegrees())], []
    found: list[Layout] = [Layout(LayoutDegrees(dp_replicate=devices)),
                           Layout(LayoutDegrees(dp_replicate=devices, zero1=True)),
                           Layout(LayoutDegrees(dp_shard=devices))]
    skipped: list[Skipped] = []
    split = divisors(devices)
    found += [Layout(LayoutDegrees(dp_replicate=devices // s, dp_shard=s)) for s in split]
    for kind, shard, tp in [("tp", 1, devices)] + [("fsdp+tp", devices // t, t) for t in split]:
        if (why := tp_refusal(cfg, vocab_size, tp)) is None:
            found.append(Layout(tensor_degrees(cfg, dp_shard=shard, tp=tp)))
        else:
            skipped.append(Skipped(kind, f"tp {tp}", why))
    for kind, shard, pp in [("pp", 1, devices)] + [("fsdp+pp", devices // p, p) for p in split]:
        if (why := pp_refusal(cfg, pp)) is None:
            found.append(Layout(LayoutDegrees(dp_shard=shard, pp=pp)))
        else:
            skipped.append(Skipped(kind, f"pp {pp}", why))
    if not split:
        why = f"{devices} devices do not factor into two degrees above 1"
        skipped += [Skipped(kind, "", why) for kind in ("hsdp", "fsdp+tp", "fsdp+pp")]
    order = {kind: i for i, kind in enumerate(KINDS)}
    found.sort(key=lambda layout: order[layout.kind])  # stable: mixes keep their ascending second degree
    return found, skipped
