"""compile=on|auto: the blocks' forward compiled in place (names, hooks and un-compiling kept), auto's
choice from this machine's records, and its mid-run trial (driven by a fake clock: which side it
keeps, what it records). The slow tests compile for real: a compiled run's losses against eager's,
and a trial inside `train()` whose verdict the next run reads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from llmtrain.config.schema import CompileMode, Config, ModelConfig
from llmtrain.core.errors import ConfigError
from llmtrain.core.files import Kind
from llmtrain.engine.compiling import (
    RECORD_MAX_AGE_S,
    CompileRecords,
    blocks_compiled,
    compile_blocks,
    decision_key,
    uncompile_blocks,
)
from llmtrain.model import GPT
from llmtrain.monitor.probes import ActivationProbe
from llmtrain.training import compile_trial
from llmtrain.training.compile_trial import TIMED_STEPS, WARM_STEPS, CompileTrial, choose_compile
from llmtrain.training.loop import train

from .conftest import RecordingMetrics, tiny_config

CPU = torch.device("cpu")


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16), 50)


def choose(cfg: Config, records: CompileRecords, *, alone: bool = True, run_s: float | None = 600.0,
           device: torch.device = CPU):
    return choose_compile(cfg, device, 2, 64, alone=alone, estimated_run_s=run_s, records=records)


def test_compile_blocks_in_place_keeps_names_and_comes_back_to_eager() -> None:
    model = tiny_gpt()
    names = list(model.state_dict())
    compile_blocks(model)
    assert blocks_compiled(model) and list(model.state_dict()) == names  # checkpoints move between the two
    first = vars(model.blocks[0])["forward"]
    compile_blocks(model)  # idempotent: no compiled-of-compiled
    assert vars(model.blocks[0])["forward"] is first
    uncompile_blocks(model)
    assert not blocks_compiled(model)


def test_on_off_cuda_and_refusals_of_a_trial(tmp_path: Path) -> None:
    records = CompileRecords(tmp_path)
    assert choose(Config(compile=CompileMode.on), records).compile
    assert not choose(Config(compile=CompileMode.off), records).compile
    auto = Config(compile=CompileMode.auto)
    assert choose(auto, records, device=torch.device("cuda")).compile  # decided without touching the GPU
    assert not choose(Config(compile=CompileMode.auto, deterministic=True), records).trial
    several = choose(auto, records, alone=False)
    assert not several.compile and not several.trial and "several processes" in several.why
    short = choose(auto, records, run_s=compile_trial.TRIAL_MIN_RUN_S / 2)
    assert not short.compile and not short.trial and "too short" in short.why
    unknown = choose(auto, records, run_s=None)  # no time estimate: no trial
    assert not unknown.trial
    trial = choose(auto, records)
    assert trial.trial and not trial.compile and trial.key == decision_key(auto, CPU, 2, 64)


def test_no_cpu_compiler_refuses_on_and_keeps_auto_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    records = CompileRecords(tmp_path)
    with pytest.raises(ConfigError, match=r"compile=on, but this machine has no C\+\+ compiler "
                                          r"\(no-such-compiler-here is not on the PATH\).*compile=auto or compile=off"):
        choose(Config(compile=CompileMode.on), records)
    auto = choose(Config(compile=CompileMode.auto), records)
    assert not auto.compile and not auto.trial and "no C++ compiler" in auto.why
    assert choose(Config(compile=CompileMode.on), records, device=torch.device("cuda")).compile  # a GPU needs none


@pytest.mark.parametrize("faster", [True, False])
def test_a_recorded_verdict_decides_the_next_run(tmp_path: Path, faster: bool) -> None:
    cfg = Config(compile=CompileMode.auto)
    records = CompileRecords(tmp_path)
    records.put(decision_key(cfg, CPU, 2, 64), {"faster": faster, "eager_ms": 30.0, "compiled_ms": 27.0 if faster else
                                                31.0, "compile_s": 2.5})
    choice = choose(cfg, records)
    assert choice.compile is faster and not choice.trial
    assert ("1.11x faster" in choice.why) if faster else ("no faster" in choice.why)
    other_shape = choose_compile(cfg, CPU, 2, 128, alone=True, estimated_run_s=600.0, records=records)
    assert other_shape.trial, "a record is for its own shape: another context is measured again"


def test_records_survive_junk_age_and_an_unwritable_folder(tmp_path: Path) -> None:
    now = [1000.0]
    records = CompileRecords(tmp_path, clock=lambda: now[0])
    assert records.put("k", {"faster": True, "eager_ms": 2.0, "compiled_ms": 1.0})
    assert records.get("k")["faster"] is True
    now[0] += RECORD_MAX_AGE_S + 1
    assert records.get("k") is None, "an old verdict is measured again"
    (tmp_path / "compile.json").write_text("{not json")
    assert records.get("k") is None  # a damaged file is no record, never a failed run
    (tmp_path / "compile.json").write_text(json.dumps({"k": {"faster": "yes"}}))
    assert records.get("k") is None
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert not CompileRecords(blocked / "sub").put("k", {"faster": False})


def drive(trial: CompileTrial, now: list[float], eager_s: float, compiled_s: float, compile_s: float = 20.0) -> int:
    """Steps of `eager_s` until the trial compiles, one compile step, then steps of `compiled_s`
    until its verdict; the step it ended at."""
    step = 0
    trial.step_done(step)  # the loop's first step: its duration is not timed (no previous boundary)
    while trial.phase == "eager":
        step += 1
        now[0] += eager_s
        assert trial.step_done(step)[0]
    step += 1
    now[0] += compile_s
    part, compiling = trial.step_done(step)
    assert part and compiling == pytest.approx(compile_s)
    while trial.running:
        step += 1
        now[0] += compiled_s
        trial.step_done(step)
    return step


@pytest.mark.parametrize(("compiled_s", "kept"), [(0.08, True), (0.099, False), (0.12, False)])
def test_the_trial_keeps_the_faster_side_and_records_it(tmp_path: Path, compiled_s: float, kept: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_trial, "TIMED_SECONDS", 0.0)  # a count of steps on each side
    now = [0.0]
    model, metrics, said = tiny_gpt(), RecordingMetrics(), []
    records = CompileRecords(tmp_path, clock=lambda: 5.0)
    trial = CompileTrial(model=model, key="k", records=records, metrics=metrics, say=said.append,
                         clock=lambda: now[0])
    end = drive(trial, now, eager_s=0.1, compiled_s=compiled_s)
    assert end == WARM_STEPS + TIMED_STEPS + 1 + 1 + TIMED_STEPS  # warm, timed, compile, settle, timed
    assert blocks_compiled(model) is kept
    (record,) = metrics.records
    assert record["kind"] == Kind.COMPILE and record["kept"] is kept and record["step"] == end
    assert record["eager_ms"] == pytest.approx(100.0) and record["compiled_ms"] == pytest.approx(compiled_s * 1e3)
    assert record["compile_s"] == pytest.approx(20.0)
    assert records.get("k")["faster"] is kept
    assert len(said) == 1 and ("-> compiled" if kept else "-> eager") in said[0]
    assert trial.step_done(end + 1) == (False, None)  # done: the steps after are the run's own


def test_a_pause_is_not_timed(tmp_path: Path) -> None:
    now = [0.0]
    trial = CompileTrial(model=tiny_gpt(), key="k", records=CompileRecords(tmp_path), metrics=RecordingMetrics(),
                         say=lambda _: None, clock=lambda: now[0])
    trial.step_done(0)
    for step in range(1, 1 + WARM_STEPS + 3):
        now[0] += 0.1
        trial.step_done(step)
    now[0] += 50.0  # an evaluation
    trial.paused()
    now[0] += 0.1
    trial.step_done(10)
    assert max(trial.durations) == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------
# For real: Inductor compiles (tens of seconds on 2 cores from a cold cache)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_compiled_block_runs_the_probe_and_matches_eager() -> None:
    model, eager = tiny_gpt(), tiny_gpt()
    compile_blocks(model)
    x = torch.randint(0, 50, (2, 16))
    probe = ActivationProbe(list(model.blocks))  # a forward hook, installed after compiling, as the monitor does
    out = model(x)
    probe.remove()
    assert probe.stats() is not None, "the hook ran around the compiled forward"
    torch.testing.assert_close(out, eager(x), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compile_on_trains_like_eager_and_auto_tries_then_remembers(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    eager = train(tiny_config(tmp_path / "eager", max_steps=20, compile=CompileMode.off))
    compiled = train(tiny_config(tmp_path / "on", max_steps=20, compile=CompileMode.on))
    for step, loss in eager.train_losses.items():
        assert compiled.train_losses[step] == pytest.approx(loss, rel=1e-4)  # the documented tolerance
    monkeypatch.setattr(compile_trial, "TRIAL_MIN_RUN_S", 0.0)
    monkeypatch.setattr(compile_trial, "TIMED_SECONDS", 0.0)
    # The verdict goes to a cache of this test's own: which side wins depends on how busy the machine
    # is, and in the session's cache it would decide whether later tests' runs of the same shape
    # compile (a sliding-window run then built its band mask inside the compiled graph, uncached).
    monkeypatch.setenv("LLMTRAIN_CACHE", str(tmp_path / "cache"))
    first = train(tiny_config(tmp_path / "trial", max_steps=40, compile=CompileMode.auto))
    records = [json.loads(line) for line in (first.run_dir / "metrics.jsonl").read_text().splitlines()]
    (verdict,) = [r for r in records if r["kind"] == Kind.COMPILE]
    assert verdict["recorded"] and verdict["compile_s"] > 0
    assert max(first.train_losses) == 40  # the run went on to its end, in whichever mode won
    again = tiny_config(tmp_path / "again", max_steps=40, compile=CompileMode.auto)
    choice = choose_compile(again, CPU, 1, 32, alone=True, estimated_run_s=600.0)
    assert not choice.trial and choice.compile is verdict["kept"]


@pytest.mark.slow
def test_compiled_blocks_follow_a_new_thread_count_without_compiling_again() -> None:
    from torch._dynamo.utils import counters

    before = torch.get_num_threads()
    model = tiny_gpt()
    compile_blocks(model)
    x = torch.randint(0, 50, (2, 16))
    try:
        torch.set_num_threads(1)
        model(x).sum().backward()
        compiled = counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"]
        misses = counters["inductor"]["fxgraph_cache_miss"]
        assert compiled > 0
        torch.set_num_threads(2)  # what threads=auto's follower does mid-run
        model(x).sum().backward()
    finally:
        torch.set_num_threads(before)
    assert counters["inductor"]["fxgraph_cache_miss"] == misses, "Inductor compiled its kernels again"


def test_an_unwritable_cache_folder_leaves_inductor_its_default(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("LLMTRAIN_CACHE", str(blocked / "cache"))  # under a file: no folder can be made there
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    compile_blocks(tiny_gpt())
    # torch's own default (under /tmp) stays, not a folder that cannot exist (every compile would fail)
    assert not os.environ.get("TORCHINDUCTOR_CACHE_DIR", "").startswith(str(blocked))
    monkeypatch.setenv("LLMTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # torch writes its default back
    compile_blocks(tiny_gpt())
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
