"""The pathology benchmark's fast subset: three sick cases and a healthy control, 60 steps each,
through `llmtrain train` as the benchmark runs them. Each sick case is caught with its true cause
ranked first; the controls (the one asked for and the reference run) raise no alarm."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SICK = {"init_too_large": "init_too_large", "lr_too_low": "lr_too_low", "fp16_no_scaler": "fp16_no_scaler"}
CONTROLS = ("c_seed1", "c_seed1337")  # the reference run (c_seed1337) always runs too


def load_benchmark() -> ModuleType:
    """benchmarks/ is not a package: load the script as a module (registered, for its dataclasses)."""
    spec = importlib.util.spec_from_file_location("pathologies", ROOT / "benchmarks" / "pathologies.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def describe(case: dict) -> str:
    return (f"{case['case']}: alarms {case['alarms']}, top cause {case['top_cause']} ({case['top_evidence']}), "
            f"exit code {case['exit_code']}")


@pytest.mark.slow
def test_the_fast_subset_catches_each_pathology_with_its_cause(tmp_path: Path) -> None:
    bench = load_benchmark()
    out = tmp_path / "scores.json"
    code = bench.main(["--only", ",".join([*SICK, "c_seed1"]), "--steps", "50", "--json", str(out),
                       "--keep", str(tmp_path / "runs")])
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
