"""`llmtrain doctor grad-check`: gradients with each activation checkpointing mode and without, in fp32 and under
autocast, and accumulated over micro-batches as the train loop does against the whole batch at once."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from llmtrain.checkpointing import CheckpointPlan
from llmtrain.config.schema import ActivationCheckpointing, Config, Precision
from llmtrain.core.findings import Finding, Status
from llmtrain.data.sampler import IGNORE_INDEX
from llmtrain.doctor.bench import (
    Bench,
    Check,
    ModelFactory,
    _precision_name,
    _verdict,
    backward,
    compare_gradients,
    gradients,
    make_bench,
    prepare_out_dir,
    render_checks,
    result_record,
    write_json,
)
from llmtrain.engine.precision import autocast_factory, native_bf16, with_scaler
from llmtrain.engine.step import Batch

# ---------------------------------------------------------------------------------------------
# grad-check
# ---------------------------------------------------------------------------------------------

CHECKPOINT_TOL = 1e-5  # relative L2 difference: the same math, recomputed, in fp32
AUTOCAST_MIN_COSINE = 0.99  # bf16 keeps ~3 significant digits: the direction must still agree
AUTOCAST_MAX_NORM_DIFF = 0.05  # |‖g_amp‖ / ‖g_fp32‖ - 1|
ACCUMULATION_TOL = 1e-5  # relative L2 difference: only the summation order differs
ACCUMULATION_MAX_MICRO = 8  # micro-batches compared (the property does not depend on the window's length)


@dataclass
class GradCheckResult:
    passed: bool
    checks: list[Check]
    seconds: float = 0.0


def run_grad_check(
    cfg: Config, out_dir: Path, console: Console, build_model: ModelFactory | None = None
) -> GradCheckResult:
    """(a) each activation checkpointing mode = none, (b) autocast close to fp32, (c) micro-batch accumulation
    as the train loop does it = the whole batch at once."""
    start = time.perf_counter()
    out_dir = prepare_out_dir(out_dir)
    bench = make_bench(cfg, console, build_model)
    console.print(f"[bold]doctor grad-check[/]: {cfg.model.name}, micro-batch {cfg.micro_batch_size} x {bench.seq_len} "
                  f"tokens, global batch {cfg.global_batch_size}, dropout {cfg.model.dropout:g}")
    checks = [*check_activation_checkpointing(bench), check_autocast(bench), *check_accumulation(bench)]
    result = GradCheckResult(all(c.passed for c in checks), checks, time.perf_counter() - start)
    render_checks(checks, console, "grad-check")
    write_json(out_dir / "grad-check.json", result_record("grad-check", result))
    console.print(f"{_verdict(result.passed)}; wrote {out_dir / 'grad-check.json'} ({result.seconds:.1f}s)")
    return result


def checkpointing_plans(bench: Bench) -> list[CheckpointPlan]:
    """The checkpointing modes grad-check compares with none: full and op on every block, and the
    config's own (with its checkpoint_every) where that is neither."""
    plans = [CheckpointPlan(ActivationCheckpointing.full), CheckpointPlan(ActivationCheckpointing.op)]
    own = CheckpointPlan.of(bench.cfg.model)
    return plans + [own] if own.enabled and own not in plans else plans


def check_activation_checkpointing(bench: Bench) -> list[Check]:
    """Each checkpointing mode (checkpointing_plans) against none: same weights, same batch and the
    same RNG seed before each forward (so the same dropout masks: checkpointing replays the RNG state
    when it recomputes); fp32. Each reports the activation memory it keeps against none's."""
    plain = bench.model(activation_checkpointing=ActivationCheckpointing.none)
    batch = bench.batch(bench.cfg.micro_batch_size)
    reference = _checkpointing_run(plain, batch, bench)
    checks = []
    for plan in checkpointing_plans(bench):
        model = bench.model(activation_checkpointing=plan.mode, checkpoint_every=plan.every)
        model.load_state_dict(plain.state_dict())
        checks.append(_compare_checkpointing(plan, reference, _checkpointing_run(model, batch, bench)))
    return checks


def _checkpointing_run(model: torch.nn.Module, batch: Batch, bench: Bench) -> tuple[dict, int, float]:
    """(gradients, activation bytes kept at the end of the forward, loss) of one micro-batch."""
    torch.manual_seed(bench.seed)
    with live_activation_bytes(model) as counter:
        loss = backward(model, [batch], bench.device)
    return gradients(model), counter["bytes"], loss


def _compare_checkpointing(plan: CheckpointPlan, reference: tuple[dict, int, float],
                           checked: tuple[dict, int, float]) -> Check:
    diff = compare_gradients(checked[0], reference[0])
    kept, plain = checked[1], reference[1]
    saved = 1 - kept / plain if plain else 0.0
    info = (f"worst parameter {diff.worst_param} ({diff.worst_rel_diff:.2e}); loss {reference[2]:.6f} none, "
            f"{checked[2]:.6f} {plan.mode.value}; activations kept for backward {plain / 2**20:.1f} MiB none, "
            f"{kept / 2**20:.1f} MiB {plan.label} ({saved:.0%} saved)")
    if kept >= plain:  # not a wrong gradient, but the memory the user asked for is not saved
        info += (f" -- {plan.label} saved NO memory: the model ignores model.activation_checkpointing (a custom "
                 "model should run its blocks through llmtrain.checkpointing.run_block)")
    return Check(Finding(
        f"activation checkpointing {plan.label} = none", Status.of(diff.finite and diff.rel_diff <= CHECKPOINT_TOL),
        f"rel. diff {diff.rel_diff:.2e}", criterion=f"<= {CHECKPOINT_TOL:g} (fp32, same RNG)", details=[info],
        fix="the checkpointed path computes something else than the plain one: an argument not passed through "
        "checkpoint() (positions, RoPE tables, masks), a stateful forward (a counter, a cache) that changes when "
        "recomputed, the RNG not replayed (preserve_rng_state=False with dropout), or (op only) an op whose saved "
        "output is modified in place afterwards",
    ), {"mode": plan.mode.value, "checkpoint_every": plan.every, "gradients": diff.as_dict(),
        "losses": [reference[2], checked[2]], "activation_bytes": [plain, kept], "saved_fraction": saved})


@contextlib.contextmanager
def live_activation_bytes(model: torch.nn.Module) -> Iterator[dict[str, int]]:
    """Bytes of the tensors created inside the block that are still alive when `model`'s forward
    returns: what autograd keeps for backward (and, under op checkpointing, the saved op outputs,
    which autograd's saved-tensor hooks never see), plus the output itself. Every op's output
    storage is tracked by a weak reference; the parameters are created before, so never counted."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    outputs: list[tuple[int, Any, int]] = []
    counter = {"bytes": 0}

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                    storage = tensor.untyped_storage()
                    outputs.append((storage.data_ptr(), storage._weak_ref(), storage.nbytes()))
            return out

    def at_forward_end(*_: object) -> None:
        alive = {ptr: size for ptr, ref, size in outputs if not torch.UntypedStorage._expired(ref)}
        counter["bytes"] = sum(alive.values())  # by address: views and aliases of one storage count once

    handle = model.register_forward_hook(at_forward_end)
    try:
        with Outputs():
            yield counter
    finally:
        handle.remove()
        for _, ref, _ in outputs:
            torch.UntypedStorage._free_weak_ref(ref)


def check_autocast(bench: Bench) -> Check:
    """fp32 against mixed precision (bf16 on CPU; the config's precision on GPU, bf16/fp16 when fp32)
    on the same weights and batch, dropout 0."""
    name = Precision.bf16  # CPU and MPS: bf16 autocast, whatever the config says (fp32 is their default)
    if bench.device.type == "cuda":
        name = Precision(_precision_name(bench.cfg, bench.device))
        if name is Precision.fp32:
            name = Precision.bf16 if native_bf16() else Precision.fp16
    precision = dataclasses.replace(bench.cfg.precision, name=name)
    model = bench.model(dropout=0.0)
    batch = bench.batch(bench.cfg.micro_batch_size)
    backward(model, [batch], bench.device)
    reference = gradients(model)
    # fp16 gradients underflow without loss scaling; scale by a constant here and divide it out.
    scaler = None
    if name is Precision.fp16:
        scaler = torch.amp.GradScaler(bench.device.type, init_scale=precision.init_scale)
    mixed_precision = with_scaler(autocast_factory(precision, bench.device.type), scaler)
    backward(model, [batch], bench.device, mixed_precision)
    mixed = gradients(model, scale=mixed_precision.loss_scale() or 1.0)
    diff = compare_gradients(mixed, reference)
    norm_diff = abs(diff.norm_ratio - 1.0)
    return Check(Finding(
        f"fp32 ~ {name.value} autocast",
        Status.of(diff.finite and diff.cosine >= AUTOCAST_MIN_COSINE and norm_diff <= AUTOCAST_MAX_NORM_DIFF),
        f"cosine {diff.cosine:.5f}, norm diff {norm_diff:.2%}",
        criterion=f"cosine >= {AUTOCAST_MIN_COSINE:g}, norm diff <= {AUTOCAST_MAX_NORM_DIFF:.0%}",
        details=[f"rel. diff {diff.rel_diff:.2e}, worst parameter {diff.worst_param} ({diff.worst_rel_diff:.2e})"
                 + ("" if diff.finite else "; NON-FINITE gradients under autocast")],
        fix="mixed precision changes the gradients beyond rounding: a loss or softmax computed in low precision, fp16 "
        "gradients underflowing without loss scaling, or a cast that cuts a tensor from the graph",
    ), {"precision": name.value, "gradients": diff.as_dict()})


def check_accumulation(bench: Bench) -> list[Check]:
    """Micro-batches accumulated the train loop's way (`accumulate_window`: loss sum / tokens in
    the window) against an independent reference: one forward of the whole batch with a plain
    token-mean cross-entropy. First the config's own split, then (when the micro-batch holds several
    sequences) one sequence per micro-batch, the split most sensitive to a wrong normalization."""
    cfg = bench.cfg
    accum = min(cfg.global_batch_size // cfg.micro_batch_size, ACCUMULATION_MAX_MICRO)
    sampler = bench.sampler(cfg.micro_batch_size, seed_offset=2)
    window = [sampler.next_batch() for _ in range(accum)]
    x, y = torch.cat([b[0] for b in window]), torch.cat([b[1] for b in window])
    model = bench.model(dropout=0.0)
    model.zero_grad(set_to_none=True)
    logits = model(x.to(bench.device))
    targets = y.to(bench.device).reshape(-1)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets,
                                             ignore_index=IGNORE_INDEX, label_smoothing=cfg.optim.label_smoothing)
    loss.backward()
    whole_loss = loss.item()
    reference = gradients(model)
    splits = [(f"{accum} x {cfg.micro_batch_size} (the config's window)", window)]
    if cfg.micro_batch_size > 1:
        splits.append((f"{x.shape[0]} x 1", [(x[i:i + 1], y[i:i + 1]) for i in range(x.shape[0])]))
    checks = []
    for label, batches in splits:
        split_loss = backward(model, batches, bench.device, label_smoothing=cfg.optim.label_smoothing)
        diff = compare_gradients(gradients(model), reference)
        checks.append(Check(Finding(
            f"accumulated {label} = whole batch", Status.of(diff.finite and diff.rel_diff <= ACCUMULATION_TOL),
            f"rel. diff {diff.rel_diff:.2e}", criterion=f"<= {ACCUMULATION_TOL:g} (fp32, dropout 0)",
            details=[f"worst parameter {diff.worst_param} ({diff.worst_rel_diff:.2e}); loss {split_loss:.6f} "
                     f"accumulated, {whole_loss:.6f} whole; {x.shape[0]} sequences, "
                     f"{int((y != IGNORE_INDEX).sum()):,} real target tokens"],
            fix="the accumulated gradient is not the big batch's: the loss is not divided by the token count of the "
            "whole window (a mean per micro-batch, or a division by the number of micro-batches when their token "
            "counts differ), or gradients are zeroed or clipped inside the window",
        ), {"gradients": diff.as_dict(), "loss": split_loss, "whole_batch_loss": whole_loss,
            "sequences": int(x.shape[0]), "real_tokens": int((y != IGNORE_INDEX).sum())}))
    return checks
