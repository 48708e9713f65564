"""The pathology benchmark (benchmarks/pathologies.py, its cases in benchmarks/pathology_cases.py).

Quick: the corpus (sizes, causes, shapes and their references), the seeded split, the override
merge, the fix parser, the cured rule and the scoring of a run's records, without training.
Slow: the fast subset through `llmtrain train` as the benchmark runs it: three sick cases caught with
their true cause ranked first, the healthy runs (the one asked for and the references) silent."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

from llmtrain.monitor.diagnosis import CAUSES

ROOT = Path(__file__).resolve().parents[1]
SICK = {"init_too_large": "init_too_large", "lr_too_low": "lr_too_low", "fp16_no_scaler": "fp16_no_scaler"}
CONTROLS = ("c_seed1", "c_seed1337", "c_fp16")  # the references of the sick cases' shapes always run too


def load_benchmark() -> ModuleType:
    """benchmarks/ is not a package: load the script as a module (registered, for its dataclasses)."""
    spec = importlib.util.spec_from_file_location("pathologies", ROOT / "benchmarks" / "pathologies.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark()


@pytest.fixture(scope="module")
def cases(bench: ModuleType) -> ModuleType:
    return sys.modules["pathology_cases"]


def describe(case: dict) -> str:
    return (f"{case['case']}: alarms {case['alarms']}, top cause {case['top_cause']} ({case['top_evidence']}), "
            f"exit code {case['exit_code']}")


def test_the_corpus_spans_enough_healthy_and_sick_runs(cases: ModuleType) -> None:
    names = [c.name for c in cases.CASES]
    assert len(names) == len(set(names)), [n for n, k in Counter(names).items() if k > 1]
    assert len(cases.HEALTHY) >= 40 and len(cases.SICK) >= 40
    causes = {c.cause for c in cases.SICK}
    assert len(causes) >= 20 and causes <= set(CAUSES), causes - set(CAUSES)
    settings = [cases.settings(c) for c in cases.SICK]
    assert {s["model"] for s in settings} == {"gpt_tiny", "modern_tiny", "llama_tiny"}
    assert {s.get("data.tokenizer", "byte") for s in settings} == {"byte", "char", "bpe"}
    assert len({s.get("optim", "adamw") for s in settings}) >= 3
    # Every run is cheap: at most ~4096 tokens a step, and one long run (the shakespeare-char recipe).
    assert max(cases.tokens_per_step(c) for c in cases.CASES) <= 4096
    assert [c.name for c in cases.CASES if c.steps > 400] == ["c_shakespeare_char"]
    # The keys the existing readers (tests, docs) name are still there.
    for name in ("c_seed1337", "c_seed1", "init_too_large", "lr_too_low", "fp16_no_scaler", "lr_30x", "unshuffled"):
        assert name in cases.BY_NAME


def test_the_whole_benchmark_fits_an_hour_on_two_cores(cases: ModuleType) -> None:
    """Even when every sick case is repaired and rerun too (the estimate: ~20 s per 200 steps of 8 x 128)."""
    assert cases.budget_seconds(cases.CASES, jobs=2, follow_ups=2) < 3600
    assert 15 < cases.estimated_seconds(cases.BY_NAME["c_seed1337"]) < 30


def test_every_shape_has_its_healthy_reference(cases: ModuleType) -> None:
    for case in cases.CASES:
        shape = cases.SHAPES[case.shape]
        reference = cases.BY_NAME[shape.reference]
        assert reference.cause is None and reference.shape == shape.name, case.name
        assert reference.overrides == shape.overrides, shape.reference  # the shape itself, seed 1337
        # A sick case is its shape plus what makes it sick: every key of the shape is there.
        keys = {cases.override_key(o) for o in case.overrides}
        assert {cases.override_key(o) for o in shape.overrides} <= keys, case.name
    assert {c.shape for c in cases.HEALTHY} == set(cases.SHAPES)


def test_the_split_is_seeded_and_stratified_by_cause(cases: ModuleType) -> None:
    halves = cases.HALVES
    assert set(halves) == set(cases.BY_NAME) and set(halves.values()) == {cases.TUNING, cases.HELD_OUT}
    assert cases.split_halves(list(reversed(cases.CASES))) == halves  # the names decide, not their order
    assert cases.split_halves(cases.CASES, cases.SPLIT_SEED + 1) != halves
    strata: dict[str | None, list[str]] = {}
    for case in cases.CASES:
        strata.setdefault(case.cause, []).append(halves[case.name])
    for cause, dealt in strata.items():
        count = Counter(dealt)
        assert abs(count[cases.TUNING] - count[cases.HELD_OUT]) <= 1, (cause, count)
        if len(dealt) >= 2:
            assert count[cases.TUNING] and count[cases.HELD_OUT], (cause, count)


def test_merge_overrides_replaces_a_key_in_place(bench: ModuleType, cases: ModuleType) -> None:
    merge = cases.merge_overrides
    assert merge(("a=1", "b.c=2", "d=3"), ("b.c=5", "e=6")) == ("a=1", "b.c=5", "d=3", "e=6")
    assert merge(("a=1",), ("+a=2", "a=3")) == ("a=3",)
    assert merge(("model=gpt_tiny", "model.n_layer=4"), ("model=llama_tiny",)) == ("model=llama_tiny",
                                                                                   "model.n_layer=4")
    # Every command the benchmark runs gives each key once (Hydra refuses a duplicate).
    for case in cases.CASES:
        for job in (bench.Job(case), bench.Job(case, "repair", bench.REPAIR),
                    bench.Job(case, "rerun", ("optim.lr=0.003", "max_steps=120", "seed=1"))):
            command = bench.command(job, Path("/runs") / job.label, "llmtrain", max_steps=50)
            keys = [cases.override_key(o) for o in command[2:]]
            assert len(keys) == len(set(keys)), (job.label, keys)
            assert f"max_steps={min(case.steps, 50) if job.kind != 'rerun' else 120}" in command


def test_the_fix_parser_keeps_only_key_value_tokens(bench: ModuleType) -> None:
    parse = bench.fix_overrides
    assert parse("optim.lr=0.003 model.dropout=0.1") == ("optim.lr=0.003", "model.dropout=0.1")
    assert parse("optim.lr=0.00053; or raise the batch (global_batch_size) x= =3 +seed=2") == (
        "optim.lr=0.00053", "+seed=2")
    assert parse("schedule.total_steps=null max_steps=150") == ("schedule.total_steps=null", "max_steps=150")
    assert parse(None) == () and parse("") == () and parse("raise the batch") == ()


def test_cured_means_within_ten_percent_of_the_reference(bench: ModuleType) -> None:
    assert bench.cured(2.2, 2.0) is True and bench.cured(1.5, 2.0) is True
    assert bench.cured(2.21, 2.0) is False
    assert bench.cured(None, 2.0) is False and bench.cured(math.nan, 2.0) is False
    assert bench.cured(math.inf, 2.0) is False
    assert bench.cured(2.0, None) is None and bench.cured(2.0, math.nan) is None


def _run_dir(root: Path, name: str, val: float, events: list[dict]) -> Path:
    run_dir = root / name
    run_dir.mkdir()
    health = [{"kind": "health", "step": s, "interval_loss": 3.0, "grad_norm": 1.0, "lr_applied": 1e-3}
              for s in (10, 20, 30)]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        *health, {"kind": "eval", "step": 20, "val_loss": 9.0}, {"kind": "eval", "step": 30, "val_loss": val}]))
    (run_dir / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events))
    return run_dir


def _alarm(cause: str, fix: str | None) -> dict:
    return {"kind": "alarm", "alarm": "grad_norm_high", "step": 20, "causes": [
        {"cause": cause, "evidence": "...", "fix": fix, "score": 0.9}]}


def test_a_sick_case_is_scored_with_its_repair_and_rerun(bench: ModuleType, cases: ModuleType,
                                                         tmp_path: Path) -> None:
    case = cases.BY_NAME["lr_10x"]
    alarm = _alarm("lr_too_high", "optim.lr=0.003 (the default)")
    repair = {"kind": "repair", "step": 20, "alarm": "grad_norm_high", "cause": "lr_too_high",
              "changes": [{"key": "optim.lr", "from": 0.03, "to": 0.003}], "rolled_back_to": 0, "applied": True,
              "rerun": None}
    done = {"c_seed1337": (_run_dir(tmp_path, "c_seed1337", 2.0, []), 0, 1.0),
            "lr_10x": (_run_dir(tmp_path, "lr_10x", 2.6, [alarm]), 0, 1.0),
            "lr_10x.repair": (_run_dir(tmp_path, "lr_10x.repair", 2.1, [alarm, repair]), 0, 1.0),
            "lr_10x.rerun": (_run_dir(tmp_path, "lr_10x.rerun", 2.3, []), 0, 1.0)}
    jobs = bench.follow_ups(case, done["lr_10x"][0], repair=True, rerun=True)
    assert [(j.kind, j.extra) for j in jobs] == [("repair", ("monitor.repair=true",)), ("rerun", ("optim.lr=0.003",))]
    assert bench.follow_ups(case, done["lr_10x"][0], repair=False, rerun=False) == []
    score = bench.score(case, done)
    assert (score.val_loss, score.reference_val_loss) == (2.6, 2.0)  # the LAST evaluation's
    assert score.right_cause and score.detected and score.first_step == 20
    assert score.repaired and score.repair_cured is True and score.repairs == [repair]
    assert score.rerun_overrides == ["optim.lr=0.003"] and score.rerun_cured is False  # 2.3 > 1.1 x 2.0
    summary = bench.summarize([score, bench.score(cases.BY_NAME["c_seed1337"], done)])
    assert (summary["repairable"], summary["repaired_cured"], summary["repaired_cured_pct"]) == (1, 1, 100.0)
    assert (summary["reruns"], summary["rerun_cured"], summary["rerun_cured_pct"]) == (1, 0, 0.0)
    assert (summary["sick"], summary["right_cause"], summary["controls"], summary["controls_with_alarms"]) == (
        1, 1, 1, 0)
    table = bench.markdown([score], {h: summary for h in (cases.HELD_OUT, cases.TUNING, "all")})
    assert "held-out figures are the ones that count" in table and "1 of 1 (100%)" in table


def test_the_wrong_cause_is_not_repaired_and_a_fix_without_overrides_not_rerun(bench: ModuleType,
                                                                               cases: ModuleType,
                                                                               tmp_path: Path) -> None:
    case = cases.BY_NAME["lr_10x"]
    wrong = _run_dir(tmp_path, "wrong", 3.0, [_alarm("no_warmup", "schedule.warmup_fraction=0.05")])
    assert [j.kind for j in bench.follow_ups(case, wrong, repair=True, rerun=True)] == ["rerun"]
    words = _run_dir(tmp_path, "words", 3.0, [_alarm("lr_too_high", "inspect the batches")])
    assert [j.kind for j in bench.follow_ups(case, words, repair=True, rerun=True)] == ["repair"]
    assert bench.follow_ups(cases.BY_NAME["c_seed1"], words, repair=True, rerun=True) == []


def test_a_half_runs_with_the_references_it_needs(bench: ModuleType, cases: ModuleType) -> None:
    parser = argparse.ArgumentParser()
    for half in (cases.TUNING, cases.HELD_OUT):
        chosen = bench.select(argparse.Namespace(only=None, half=half), parser)
        names = {c.name for c in chosen}
        asked = {c.name for c in cases.CASES if cases.HALVES[c.name] == half}
        assert asked <= names
        assert names - asked <= {s.reference for s in cases.SHAPES.values()}
        assert {cases.SHAPES[c.shape].reference for c in chosen} <= names
    only = bench.select(argparse.Namespace(only="fp16_no_scaler,c_seed1", half="all"), parser)
    assert [c.name for c in only] == [c.name for c in cases.CASES if c.name in {*CONTROLS, "fp16_no_scaler"}]


@pytest.mark.slow
def test_the_fast_subset_catches_each_pathology_with_its_cause(tmp_path: Path) -> None:
    bench = load_benchmark()
    out = tmp_path / "scores.json"
    code = bench.main(["--only", ",".join([*SICK, "c_seed1"]), "--steps", "50", "--no-repair", "--no-rerun",
                       "--json", str(out), "--keep", str(tmp_path / "runs")])
    assert code == 0
    scores = json.loads(out.read_text())
    cases = {c["case"]: c for c in scores["cases"]}
    assert set(cases) == {*SICK, *CONTROLS}
    for name, cause in SICK.items():
        case = cases[name]
        assert case["detected"] and case["latency"] is not None and case["latency"] <= 100, describe(case)
        assert case["top_cause"] == cause, describe(case)
    for name in CONTROLS:
        assert cases[name]["alarms"] == [] and cases[name]["exit_code"] == 0, describe(cases[name])
    summary = scores["summary"]
    assert (summary["sick"], summary["right_cause"], summary["controls_with_alarms"]) == (3, 3, 0)
    assert summary["repair_runs"] == summary["reruns"] == 0  # --no-repair --no-rerun
    halves = scores["summaries"]
    assert halves["tuning"]["sick"] + halves["held-out"]["sick"] == 3
    assert scores["split_seed"] == sys.modules["pathology_cases"].SPLIT_SEED
    # Every run was capped at 50 steps: its last health check is at step 50.
    steps = [json.loads(line)["step"] for line in (tmp_path / "runs" / "c_seed1" / "metrics.jsonl").read_text()
             .splitlines() if json.loads(line)["kind"] == "health"]
    assert steps[-1] == 50


def test_steps_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark()
    with pytest.raises(SystemExit) as exited:
        bench.main(["--steps", "0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--steps 0" in err and "positive" in err and "Traceback" not in err


def test_calibration_reads_the_healthy_runs_extremes(tmp_path: Path) -> None:
    """benchmarks/calibrate.py on two made-up healthy run dirs: each statistic's worst run, and its
    margin to the default threshold."""
    spec = importlib.util.spec_from_file_location("calibrate", ROOT / "benchmarks" / "calibrate.py")
    assert spec is not None and spec.loader is not None
    calibrate = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = calibrate  # its dataclasses look their module up
    spec.loader.exec_module(calibrate)
    for name, top in (("c_seed1337", 2.0), ("c_seed1", 4.0)):
        run = tmp_path / name
        run.mkdir()
        # c_seed1's high norm lasts two checks (a surge the alarm would see), c_seed1337's one.
        spiked = (8, 9) if name == "c_seed1" else (8,)
        health = [{"kind": "health", "step": 10 * (i + 1), "grad_norm": top if i in spiked else 1.0,
                   "param_norm": 100.0, "update_ratio": 0.01, "lr_applied": 1e-3, "loss": 3.0 - 0.01 * i,
                   "interval_loss": 3.0 - 0.01 * i}
                  for i in range(12)]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in health) + "\n")
    rows, n_runs = calibrate.calibrate(tmp_path)
    by_alarm = {row["alarm"]: row for row in rows}
    assert n_runs == 2
    assert by_alarm["grad_norm_high"]["worst"] == 4.0 and by_alarm["grad_norm_high"]["margin"] == 25.0
    assert by_alarm["grad_norm_surge"]["worst"] == 4.0  # 4 over a median of 1, twice running
    assert by_alarm["grad_norm_surge"]["worst_run"] == "c_seed1"
    assert by_alarm["weight_decay_dominant"]["worst"] == pytest.approx(1e-3 * 0.1 / 0.01)  # no config.yaml: 0.1
    assert by_alarm["loss_rising"]["worst"] == 0.0  # a steady fall never rises above its best


def test_a_sick_run_the_pre_flight_check_warned_about_counts_as_flagged_before(bench: ModuleType,
                                                                                cases: ModuleType,
                                                                                tmp_path: Path) -> None:
    quiet = _run_dir(tmp_path, "sgd_no_momentum", 3.0, [])  # no alarm during the run
    metrics = quiet / "metrics.jsonl"
    start = {"kind": "start", "check": {"momentum": "WARN", "token budget": "WARN", "warmup": "PASS"}}
    metrics.write_text(json.dumps(start) + "\n" + metrics.read_text())
    done = {"c_sgd": (_run_dir(tmp_path, "c_sgd", 2.0, []), 0, 1.0), "sgd_no_momentum": (quiet, 0, 1.0)}
    score = bench.score(cases.BY_NAME["sgd_no_momentum"], done)
    assert score.check_warnings == ["momentum", "token budget"]
    assert score.flagged_before and not score.detected
    summary = bench.summarize([score])
    assert (summary["detected"], summary["flagged_or_detected"]) == (0, 1)
    # A warning on an item that does not speak of the cause flags nothing.
    start["check"] = {"token budget": "WARN"}
    metrics.write_text(json.dumps(start) + "\n" + metrics.read_text().split("\n", 1)[1])
    assert not bench.score(cases.BY_NAME["sgd_no_momentum"], done).flagged_before
