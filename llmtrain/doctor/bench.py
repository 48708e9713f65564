"""The shared part of `llmtrain doctor`: the bench (device, data and models, built by the same
builders as `llmtrain train`: training/setup.py), the out-dir and strict-JSON helpers, the gradient
helpers and the `Check` table used by several experiments."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from torch import nn

from llmtrain.config.derived import model_vocab_size, seq_len_of
from llmtrain.config.schema import Config
from llmtrain.config.threads import parse_threads
from llmtrain.config.validate import validate
from llmtrain.core.atomic import write_atomically
from llmtrain.core.errors import ConfigError, UserError
from llmtrain.core.files import json_safe
from llmtrain.core.findings import Column, Finding, Status, badge, render_table
from llmtrain.data.cache import PreparedData
from llmtrain.distributed.layout import Layout
from llmtrain.engine.precision import NumericPrecision, resolve_precision
from llmtrain.engine.step import Batch, accumulate_window
from llmtrain.engine.timing import StepTimer
from llmtrain.model import GPT
from llmtrain.training.setup import ModelFactory, build_data, build_runtime, build_train_sampler, new_model

ONE_PROCESS = Layout()  # a doctor experiment runs in this process alone


# ---------------------------------------------------------------------------------------------
# the bench: device, data and models, shared by every experiment
# ---------------------------------------------------------------------------------------------


@dataclass
class Bench:
    """What an experiment works on: the config, its device, the prepared data and the model factory."""

    cfg: Config
    device: torch.device
    data: PreparedData
    vocab_size: int
    seq_len: int
    seed: int
    build_model: ModelFactory

    def model(self, **changes: Any) -> nn.Module:
        """A fresh model of the config's model section with `changes` (e.g. dropout=0.0), in train
        mode. Seeded the same every time, so models that differ only in dropout or checkpointing
        start from the same weights (the experiments still copy weights where they compare)."""
        torch.manual_seed(self.seed)
        return new_model(dataclasses.replace(self.cfg.model, **changes), self.vocab_size, self.device,
                         factory=self.build_model)

    def sampler(self, batch_size: int, seq_len: int | None = None, seed_offset: int = 0) -> Any:
        """The train split's batches as the train loop draws them (its sampler: whole instruction
        examples with prompt tokens masked out of the loss, epochs, or random windows)."""
        seq_len = seq_len or self.seq_len
        seed = (self.cfg.data.seed if self.cfg.data.seed is not None else self.seed) + seed_offset
        try:
            return build_train_sampler(self.cfg, self.data, batch_size, seq_len, seed, ONE_PROCESS)
        except ValueError as err:
            raise ConfigError(f"the train split cannot give a batch of {batch_size} x {seq_len} tokens ({err}); "
                              "use more data, a shorter data.seq_len or a smaller micro_batch_size.") from None

    def batch(self, batch_size: int, seq_len: int | None = None) -> Batch:
        """One batch, on the device."""
        x, y = self.sampler(batch_size, seq_len).next_batch()
        return x.to(self.device), y.to(self.device)


def make_bench(cfg: Config, console: Console, build_model: ModelFactory | None = None) -> Bench:
    """Runtime (device, seed, threads, deterministic kernels, subnormals) and prepared data, built as
    `llmtrain train` builds them; user mistakes (too little data for the longest stage, a
    vocabulary too small) raise ConfigError before any compute."""
    validate(cfg)  # the CLI's config already is; a direct API call gets the same checks
    # An unseeded config still gets a repeatable diagnosis: a doctor run is an experiment, not a run.
    runtime = build_runtime(cfg, ONE_PROCESS, unseeded=lambda: 0)
    data = build_data(cfg, ONE_PROCESS, lambda message: console.print(f"[dim]{escape(message)}[/]"),
                      progress=console.is_terminal)
    vocab_size = model_vocab_size(cfg, data.vocab_size)
    return Bench(cfg, runtime.device, data, vocab_size, seq_len_of(cfg), runtime.seed, build_model or GPT)


def fastest_threads(bench: Bench, model: nn.Module, batch: Batch, precision: NumericPrecision,
                    console: Console) -> int:
    """On CPU, with threads=auto: keep the thread count auto picked from the free cores or drop to 1,
    whichever runs this experiment's forward/backward faster (timed, gradients discarded): the cores
    can fill up after start-up, and this times the experiment's own op sizes. OpenMP threads spin-wait
    for each other, so when another process holds a core a small step slows down many times (measured
    on 2 cores next to a training run: 1.2 s per overfit step with 2 threads, 17 ms with 1)."""
    current = torch.get_num_threads()
    if bench.device.type != "cpu" or parse_threads(bench.cfg.threads) is not None or current == 1:
        return current
    timings = {}
    for threads in (current, 1):
        torch.set_num_threads(threads)
        backward(model, [batch], bench.device, precision)  # warm-up
        begin = time.perf_counter()
        for _ in range(2):
            backward(model, [batch], bench.device, precision)
        timings[threads] = (time.perf_counter() - begin) / 2
    model.zero_grad(set_to_none=True)
    best = min(timings, key=timings.get)
    torch.set_num_threads(best)
    if best != current:
        console.print(f"[dim]1 CPU thread: {timings[1] * 1e3:.0f} ms per forward/backward against "
                      f"{timings[current] * 1e3:.0f} ms with {current} (the cores are busy elsewhere)[/]")
    return best


# ---------------------------------------------------------------------------------------------
# helpers shared by the experiments: out dir, strict JSON, report, plots
# ---------------------------------------------------------------------------------------------


def prepare_out_dir(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out is '{out_dir}', which is not a folder; give a folder for the plots and results "
                        "(it is created when missing).")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out is '{out_dir}', which cannot be created ({err.strerror or err}); give a folder "
                        "you can write to.") from None
    return out_dir


def write_json(path: Path, payload: dict) -> None:
    """Strict JSON: non-finite floats (a diverged loss) become the strings "nan"/"inf"."""
    write_atomically(path, json.dumps(json_safe(payload), indent=2) + "\n")




def _param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _verdict(passed: bool) -> str:
    return badge(Status.of(passed))


def _precision_name(cfg: Config, device: torch.device) -> str:
    return resolve_precision(cfg.precision.name, device).value


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _names(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ---------------------------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------------------------


FP32 = NumericPrecision()  # no autocast, no loss scaling: the reference the doctor compares against


def backward(
    model: nn.Module, batches: list[Batch], device: torch.device, precision: NumericPrecision = FP32,
    label_smoothing: float = 0.0,
) -> float:
    """The train loop's forward/backward of one accumulation window (`accumulate_window`) on zeroed
    gradients, untimed; the mean loss."""
    model.zero_grad(set_to_none=True)
    window = accumulate_window(model, batches, device, precision, StepTimer(0, device), label_smoothing=label_smoothing)
    return float(window.item())


def gradients(model: nn.Module, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Name -> fp32 copy of each trainable parameter's gradient (zeros where it got none)."""
    return {name: (p.grad.detach().float() / scale if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
            for name, p in model.named_parameters() if p.requires_grad}


@dataclass
class GradDiff:
    """How far gradients `a` are from reference gradients `b`."""

    rel_diff: float  # ||a - b|| / ||b|| over all parameters together
    cosine: float  # cosine similarity of the flattened gradients
    norm_ratio: float  # ||a|| / ||b||
    worst_param: str  # the parameter with the largest relative difference
    worst_rel_diff: float
    finite: bool

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def compare_gradients(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> GradDiff:
    flat_a = torch.cat([g.flatten() for g in a.values()]).double()
    flat_b = torch.cat([b[name].flatten() for name in a]).double()
    norm_b = float(flat_b.norm())
    tiny = 1e-30
    per_param = {name: float((a[name].double() - b[name].double()).norm() / max(float(b[name].double().norm()), tiny))
                 for name in a if float(b[name].norm()) > 0 or float(a[name].norm()) > 0}
    worst = max(per_param, key=per_param.get) if per_param else ""
    return GradDiff(
        rel_diff=float((flat_a - flat_b).norm()) / max(norm_b, tiny),
        cosine=float(torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0)),
        norm_ratio=float(flat_a.norm()) / max(norm_b, tiny),
        worst_param=worst,
        worst_rel_diff=per_param.get(worst, 0.0),
        finite=bool(torch.isfinite(flat_a).all()),
    )


# ---------------------------------------------------------------------------------------------
# checks: the table of measured comparisons grad-check and eval-consistency print
# ---------------------------------------------------------------------------------------------


@dataclass
class Check:
    """One measured comparison: its Finding (item: the check's name; seen: the number that decided it;
    criterion: the bar it had to clear; details: more numbers, printed under the table; fix: what a
    failure points at, printed when it failed) and everything measured, for the JSON file."""

    finding: Finding
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.finding.item

    @property
    def passed(self) -> bool:
        return self.finding.status is Status.PASS

    def record(self) -> dict[str, Any]:
        """The check as the experiment's JSON file keeps it."""
        f = self.finding
        return {"name": f.item, "passed": self.passed, "measured": f.seen, "tolerance": f.criterion,
                "info": "; ".join(f.details), "hint": f.fix, "details": self.details}


CHECK_COLUMNS = [Column("check", "item"), Column("result", "status"), Column("measured", "seen"),
                 Column("pass when", "criterion")]


def render_checks(checks: list[Check], console: Console, title: str) -> None:
    """A table (check, verdict, the deciding number, the criterion), then the details of each check,
    and what each failure points at."""
    render_table(console, [c.finding for c in checks], CHECK_COLUMNS, f"doctor {title}", notes=True)


def result_record(experiment: str, result: Any) -> dict[str, Any]:
    """An experiment's result (a dataclass with `checks`) for its JSON file."""
    record = {"experiment": experiment, **dataclasses.asdict(result)}
    record["checks"] = [check.record() for check in result.checks]
    return record
