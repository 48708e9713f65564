"""The memory savers (llmtrain/preflight/savers.py): ordered cheapest first, each one's peak the one
estimate of the config with its overrides, listed by the check's memory row and `llmtrain plan`,
applied by the memory_saver preset; one real run shows the top saver's peak under the budget."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

import llmtrain.preflight.facts as facts_module
import llmtrain.preflight.savers as savers_module
from llmtrain.config.derived import accumulation_steps
from llmtrain.config.schema import ActivationCheckpointing, OptimizerName, Precision, config_to_dict
from llmtrain.config.validate import validate
from llmtrain.core.findings import Status
from llmtrain.plan.build import plan_config
from llmtrain.plan.render import saver_lines
from llmtrain.preflight.check import run_check
from llmtrain.preflight.estimate import estimate_memory, model_shape
from llmtrain.preflight.facts import MEMORY_WARN_FRACTION, gather_facts
from llmtrain.preflight.savers import (
    EstimateBasis,
    apply_memory_saver,
    memory_savers,
    predicted_peak,
    with_overrides,
)

from .conftest import predicted_and_measured_peak, tiny_config

# activations dominate: a smaller micro-batch and checkpointing both help
HEAVY = {"micro_batch_size": 64, "global_batch_size": 128, "model.block_size": 256, "model.n_embd": 128,
         "model.n_head": 4, "model.n_layer": 4, "max_steps": 100, "schedule.warmup_steps": 5}


def heavy(tmp_path: Path, **overrides: object):
    return tiny_config(tmp_path, **{**HEAVY, **overrides})


def basis_of(cfg) -> tuple[EstimateBasis, float]:
    f = gather_facts(cfg, measure_compute=False)
    return EstimateBasis.of_facts(f), f.memory.peak


@pytest.fixture(autouse=True)
def fresh_process_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process's own footprint as a fresh `llmtrain` process has it: the estimate adds this
    process's RSS, and a test process's grows with every test before it (compiled graphs, loaded
    models), which would shrink the budgets and change the savers that fit. A fresh `llmtrain`
    process (the slow test's) holds about this much."""
    monkeypatch.setattr(facts_module, "runtime_bytes", lambda device: 400 * 2**20)


def test_savers_are_cheapest_first_and_each_peak_is_the_estimate_with_its_overrides(tmp_path: Path) -> None:
    cfg = heavy(tmp_path)
    basis, peak = basis_of(cfg)
    assert predicted_peak(cfg, basis) == pytest.approx(peak)  # no overrides: the memory row's figure
    savers = memory_savers(cfg, basis, peak * 0.8)
    assert savers and all(s.fits for s in savers)
    assert [s.order for s in savers] == sorted(s.order for s in savers)
    for s in savers:
        alt = with_overrides(cfg, s.overrides)
        expected = estimate_memory(alt, model_shape(alt, basis.vocab_size), basis.vocab_size, "cpu", basis.precision,
                                   runtime_bytes=basis.runtime_bytes, data_bytes=basis.data_bytes).peak
        assert s.peak == pytest.approx(expected)
        assert s.peak <= peak * 0.8


def test_every_saver_is_ordered_by_its_cost(tmp_path: Path) -> None:
    """With a budget everything fits, every single saver is listed: the same optimizer before
    Adafactor, and by step time among them (op every 2 blocks before full on every block)."""
    cfg = heavy(tmp_path)
    basis, _ = basis_of(cfg)
    commands = [s.command for s in memory_savers(cfg, basis, math.inf)]
    assert commands.index("model.activation_checkpointing=op model.checkpoint_every=2") < commands.index(
        "model.activation_checkpointing=full")
    assert commands[-1] == "optim=adafactor"
    assert any(c.startswith("micro_batch_size=") for c in commands)


def test_a_config_that_does_not_fit_gets_a_fitting_saver_first_or_the_nearest(tmp_path: Path) -> None:
    cfg = heavy(tmp_path)
    basis, peak = basis_of(cfg)
    # a budget that leaves the run 30% of what it adds to the process (whose own resident memory,
    # which no saver changes, is this test process's, and grows with the tests run before it)
    fixed = basis.runtime_bytes + basis.data_bytes
    budget = fixed + (peak - fixed) * 0.3  # no single saver: a combination
    tight = memory_savers(cfg, basis, budget)
    assert tight and tight[0].fits and tight[0].peak <= budget
    nothing = memory_savers(cfg, basis, basis.runtime_bytes)  # not even the process itself fits
    assert len(nothing) == 1 and not nothing[0].fits
    assert nothing[0].peak < min(s.peak for s in memory_savers(cfg, basis, math.inf))  # the leanest combination


def test_the_memory_row_names_the_savers_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = heavy(tmp_path)
    f = gather_facts(cfg, measure_compute=False)
    monkeypatch.setattr(facts_module, "available_memory", lambda device: (f.memory.peak * 0.8 - f.memory.runtime,
                                                                           "test budget"))
    report = run_check(cfg, measure_compute=False)
    row = report.row("memory")
    assert row.status is Status.FAIL
    savers = memory_savers(cfg, EstimateBasis.of_facts(report.facts), report.facts.memory_budget * MEMORY_WARN_FRACTION)
    assert row.fix.startswith(savers[0].command + " (peak ")
    assert "preset=memory_saver applies the first" in row.fix


def test_plan_lists_the_same_savers_when_one_device_does_not_fit(tmp_path: Path) -> None:
    cfg = heavy(tmp_path)
    basis, peak = basis_of(cfg)
    plan = plan_config(cfg, devices=1, device_memory=peak * 0.8 / MEMORY_WARN_FRACTION)
    assert plan.one_device is not None
    plan_peak, savers = plan.one_device
    assert plan_peak == pytest.approx(peak, rel=0.02)  # this process's memory moved a little in between
    lines = saver_lines(plan)
    assert "cheapest first" in lines[0] and savers[0].command in lines[1]
    assert plan_config(cfg, devices=1, device_memory=peak * 4).one_device is None


def test_the_preset_applies_the_cheapest_fitting_saver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = heavy(tmp_path, memory_saver=True)
    f = gather_facts(cfg, measure_compute=False)
    monkeypatch.setattr(facts_module, "available_memory", lambda device: (f.memory.peak * 0.8 - f.memory.runtime,
                                                                           "test budget"))
    applied, line, overrides = apply_memory_saver(cfg)
    f = gather_facts(cfg, measure_compute=False)
    first = memory_savers(cfg, EstimateBasis.of_facts(f), f.memory_budget * MEMORY_WARN_FRACTION)[0]
    assert overrides == first.overrides and line.startswith(f"memory_saver: applied {first.command}: predicted peak")
    assert "->" in line
    saved = config_to_dict(applied)  # what config.yaml holds
    for key, value in overrides.items():
        node = saved
        for part in key.split("."):
            node = node[part]
        assert str(node.value if hasattr(node, "value") else node) == value
    assert applied.global_batch_size == cfg.global_batch_size
    if "micro_batch_size" in overrides:
        assert applied.micro_batch_size * accumulation_steps(applied) == cfg.global_batch_size
    assert cfg.micro_batch_size == 64  # the config given is not modified
    assert run_check(applied, measure_compute=False).row("memory").status is not Status.FAIL


def test_the_preset_leaves_a_config_that_fits_as_it_is(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, memory_saver=True)
    applied, line, overrides = apply_memory_saver(cfg)
    assert applied is cfg and overrides == {} and "nothing changed" in line
    off = tiny_config(tmp_path)
    assert apply_memory_saver(off) == (off, None, {})


def test_8bit_adamw_is_offered_only_where_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed")
    cfg = heavy(tmp_path)
    basis, _ = basis_of(cfg)

    def offered(c) -> set[str]:
        return {s.overrides.get("optim") for s in memory_savers(c, basis, math.inf)}

    assert OptimizerName.adamw8bit.value in offered(cfg)
    tp = heavy(tmp_path, **{"parallel.nproc": 2, "parallel.tp": 2, "global_batch_size": 128, "micro_batch_size": 64})
    assert OptimizerName.adamw8bit.value not in offered(tp)  # refused under tensor parallel
    assert OptimizerName.adamw8bit.value not in offered(heavy(tmp_path, **{"optim.name": OptimizerName.sgd}))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert OptimizerName.adamw8bit.value not in offered(cfg)


def test_checkpointing_savers_keep_less_than_the_config(tmp_path: Path) -> None:
    cfg = heavy(tmp_path, **{"model.activation_checkpointing": ActivationCheckpointing.full})
    basis, _ = basis_of(cfg)
    assert not any("model.activation_checkpointing" in s.overrides for s in memory_savers(cfg, basis, math.inf))


@pytest.mark.slow  # a real two-step run in a fresh process
def test_the_top_saver_applied_measures_a_peak_under_the_budget(tmp_path: Path) -> None:
    """An artificial budget just below the config's predicted peak: the top saver, applied, trains
    two steps with a measured peak under it (the prediction in the run's own process)."""
    predict = "\n".join([
        "from llmtrain.preflight.facts import gather_facts",
        "from llmtrain.preflight.savers import EstimateBasis, memory_savers, with_overrides",
        "f = gather_facts(cfg, measure_compute=False)",
        "budget = f.memory.peak * 0.9",
        "top = memory_savers(cfg, EstimateBasis.of_facts(f), budget)[0]",
        "assert top.fits, top",
        "cfg = with_overrides(cfg, top.overrides)",
        "predicted = [budget, top.peak, top.command]",
    ])
    (budget, top_peak, command), measured = predicted_and_measured_peak(
        tmp_path, {k: v for k, v in HEAVY.items() if k not in ("max_steps", "schedule.warmup_steps")}, predict)
    assert top_peak <= budget
    assert measured < budget, (f"{command}: measured {measured / 2**20:.0f} MiB, predicted {top_peak / 2**20:.0f} MiB, "
                               f"budget {budget / 2**20:.0f} MiB")


@pytest.mark.slow  # a fresh `llmtrain train` process (apply_memory_saver itself: fast tests above)
def test_train_with_the_preset_applies_a_saver_and_saves_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`llmtrain train memory_saver=true` on a config that does not fit this (patched) budget: one
    line says what was applied, and the run's config.yaml holds it."""
    import yaml

    from llmtrain.cli.compose import compose_config

    from .conftest import TINY_CORPUS, run_cli

    args = ["data=text", f"data.path={TINY_CORPUS}", "data.tokenizer=char", "model.n_layer=4", "model.n_embd=128",
            "model.n_head=4", "model.block_size=256", "micro_batch_size=64", "global_batch_size=128", "max_steps=1",
            "schedule.warmup_steps=0", "eval_interval=0", "checkpoint=none", "report.enabled=false", "threads=1",
            "device=cpu"]
    f = gather_facts(compose_config(args), measure_compute=False)
    monkeypatch.setattr(facts_module, "available_memory", lambda device: (f.memory.peak * 0.8 - f.memory.runtime,
                                                                           "test budget"))
    run = tmp_path / "run"
    proc = run_cli("train", *args, "memory_saver=true", f"hydra.run.dir={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("memory_saver: applied micro_batch_size="))
    micro = int(line.split("micro_batch_size=")[1].split(":")[0].split()[0])
    assert micro < 64 and yaml.safe_load((run / "config.yaml").read_text())["micro_batch_size"] == micro


# ---- a LoRA fine-tune: QLoRA stores its frozen base in 4 bits -----------------------------------

@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from .test_hf_init import save_llama

    return save_llama(tmp_path_factory.mktemp("hf") / "llama")


def lora_run(folder: Path, *extra: str):
    from llmtrain.cli.compose import compose_config

    from .test_hf_init import TEXT

    return compose_config([f"model.init_from={folder}", "finetune=lora", "finetune.rank=4", *TEXT, "data.seq_len=32",
                           "micro_batch_size=2", "global_batch_size=4", *extra])


def test_a_lora_run_that_does_not_fit_is_offered_qlora_with_its_own_adapter_settings(llama_folder: Path) -> None:
    pytest.importorskip("torchao", reason="finetune=qlora needs torchao")
    cfg = lora_run(llama_folder)
    basis = EstimateBasis(cfg.model.vocab_size, "cpu", Precision.fp32)
    lora_peak = predicted_peak(cfg, basis)
    qlora_peak = predicted_peak(cfg, basis, {"finetune.method": "qlora"})
    assert qlora_peak < lora_peak  # the block linears in NF4: ~0.52 bytes a weight against 4
    savers = memory_savers(cfg, basis, (lora_peak + qlora_peak) / 2)
    qlora = next(s for s in savers if s.overrides == {"finetune.method": "qlora"})
    assert qlora.fits and qlora.peak == pytest.approx(qlora_peak) and qlora.command == "finetune.method=qlora"
    assert "4-bit NF4" in qlora.cost and "quantized base" in qlora.cost
    # ordered after every saver that keeps the run's results, whatever their step time
    assert all(s.changes_results for s in savers[savers.index(qlora):])
    applied = with_overrides(cfg, qlora.overrides)
    assert applied.finetune.method.value == "qlora" and applied.finetune.rank == 4  # the adapters as configured
    validate(applied)


@pytest.mark.parametrize("extra", [["finetune=full"], ["parallel=ddp", "parallel.nproc=2"]])
def test_qlora_is_not_offered_where_the_run_could_not_take_it(llama_folder: Path, extra: list[str]) -> None:
    pytest.importorskip("torchao", reason="finetune=qlora needs torchao")
    assert savers_module._finetune_parts(lora_run(llama_folder)) != []  # the run as the test above has it: offered
    assert savers_module._finetune_parts(lora_run(llama_folder, *extra)) == []  # a full fine-tune; two processes


def test_qlora_is_not_offered_without_torchao(llama_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec  # as the optimizers' test hides it: the one check all of them use
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert savers_module._finetune_parts(lora_run(llama_folder)) == []
