"""`llmtrain eval` end to end on a tiny trained run: what it evaluates when, eval.json (written
whole, merged across invocations, an unreadable one kept), the table, and the refusals that come
before the model is loaded."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmtrain.cli import main
from llmtrain.evaluation.scoring import Scorer, rolling_requests
from llmtrain.runs.artifacts import load_run
from llmtrain.training.loop import train
from tests.conftest import TINY_CORPUS, tiny_config

HELD_OUT = "The quick brown fox jumps over the lazy dog.\nA second line of held-out text.\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("eval_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        train(tiny_config(out, max_steps=4, report=False))
    return out


@pytest.fixture
def held_out(tmp_path: Path) -> Path:
    # only characters of the tiny corpus: the run's char tokenizer must encode it
    text = TINY_CORPUS.read_text()
    path = tmp_path / "held_out.txt"
    path.write_text(text[: len(text) // 3])
    return path


def _eval(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    try:
        main(["eval", *args])
        code = 0
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _direct_nll(run_dir: Path, text: str) -> tuple[float, int]:
    """Summed nats and tokens of `text` as one document, computed without the task code."""
    run = load_run(run_dir)
    ids = run.tokenizer.encode(text)
    window = run.context
    scores = Scorer(run.model, window, 4).loglikelihood(rolling_requests(ids, run.tokenizer.eos_id, window))
    return -sum(s.logprob for s in scores), len(ids)


def test_perplexity_of_a_held_out_file_from_data_overrides(
    run_dir: Path, held_out: Path, capsys, tmp_path: Path
) -> None:
    out = tmp_path / "results"
    code, stdout, err = _eval(capsys, str(run_dir), "data=text", f"data.path={held_out}", "--out", str(out))
    assert code == 0, err
    results = json.loads((out / "eval.json").read_text())
    entry = results["tasks"][f"perplexity:{held_out}"]
    nll, tokens = _direct_nll(run_dir, held_out.read_text())
    assert entry["tokens"] == tokens and entry["bytes"] == len(held_out.read_bytes())
    assert entry["loss"] == pytest.approx(nll / tokens, rel=1e-6)
    assert entry["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-6)
    assert entry["bits_per_byte"] == pytest.approx(nll / math.log(2) / len(held_out.read_bytes()), rel=1e-6)
    assert results["context"] == 32 and results["model"] == str(run_dir.resolve())
    assert f"perplexity:{held_out}" in stdout and "bits/byte" in stdout and "results in" in stdout
    assert not (run_dir / "eval.json").exists()  # --out given: the run dir is left alone


def test_later_tasks_add_to_eval_json_and_a_rerun_replaces_its_entry(run_dir: Path, held_out: Path, capsys,
                                                                     tmp_path: Path) -> None:
    out = tmp_path / "results"
    choices = tmp_path / "choices.jsonl"
    choices.write_text("\n".join(json.dumps({"ctx": "def ", "endings": ["return", "zzzz", "class"], "label": i % 3})
                                 for i in range(4)) + "\n")
    assert _eval(capsys, str(run_dir), f"eval.tasks=[perplexity:{held_out}]", "--out", str(out))[0] == 0
    first = json.loads((out / "eval.json").read_text())["tasks"]
    code, stdout, err = _eval(capsys, str(run_dir), f"eval.tasks=[multiple_choice:{choices}]", "eval.batch_size=1",
                              "--out", str(out))
    assert code == 0, err
    tasks = json.loads((out / "eval.json").read_text())["tasks"]
    assert set(tasks) == {f"perplexity:{held_out}", f"multiple_choice:{choices}"}
    assert tasks[f"perplexity:{held_out}"] == first[f"perplexity:{held_out}"]  # kept as it was
    assert tasks[f"multiple_choice:{choices}"]["examples"] == 4
    assert 0.0 <= tasks[f"multiple_choice:{choices}"]["acc"] <= 1.0 and "acc_norm" in stdout


def test_a_run_dir_without_tasks_evaluates_its_validation_split(run_dir: Path, capsys, tmp_path: Path) -> None:
    code, stdout, err = _eval(capsys, str(run_dir), "--out", str(tmp_path))
    assert code == 0, err
    assert "validation split" in stdout
    entry = json.loads((tmp_path / "eval.json").read_text())["tasks"]["perplexity:validation"]
    assert entry["tokens"] > 0 and math.isfinite(entry["loss"]) and entry["bits_per_byte"] > 0


def test_an_unreadable_eval_json_is_kept_aside(run_dir: Path, held_out: Path, capsys, tmp_path: Path) -> None:
    (tmp_path / "eval.json").write_text("{not json")
    assert _eval(capsys, str(run_dir), f"eval.tasks=[perplexity:{held_out}]", "--out", str(tmp_path))[0] == 0
    assert (tmp_path / "eval.json.unreadable").read_text() == "{not json"
    assert f"perplexity:{held_out}" in json.loads((tmp_path / "eval.json").read_text())["tasks"]


@pytest.mark.parametrize(("args", "expected"), [
    (["model.n_layer=4"], "eval.* and data overrides only"),
    (["eval.tasks=[perplexity]"], "perplexity"),
    (["eval.tasks=[ppl:x.txt]"], "ppl"),
    (["eval.tasks=[perplexity:/no/such/held_out.txt]"], "/no/such/held_out.txt"),
    (["harness.tasks=[]"], "names no task"),
    (["--device", "bogus"], "not a device name"),
    (["eval.tasks=perplexity:x.txt"], "a list in brackets, of strings"),
])
def test_bad_arguments_are_refused_in_one_paragraph_and_write_nothing(run_dir: Path, capsys, tmp_path: Path,
                                                                      args: list[str], expected: str) -> None:
    code, _, err = _eval(capsys, str(run_dir), *args, "--out", str(tmp_path / "out"))
    assert code == 2
    assert expected in err and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_bad_line_refuses_before_the_model_loads_and_keeps_eval_json(run_dir: Path, capsys, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "eval.json").write_text('{"tasks": {"kept": {"kind": "perplexity", "loss": 1.0}}}')
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"ctx": "a", "endings": ["b", "c"], "label": 0}) + "\n"
                   + '{"ctx": "a", "endings": ["b"]\n')

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the task file was checked")

    monkeypatch.setattr("llmtrain.runs.artifacts.load_run", no_model)
    code, _, err = _eval(capsys, str(run_dir), f"eval.tasks=[multiple_choice:{bad}]", "--out", str(tmp_path))
    assert code == 2 and f"{bad}:2" in err, err
    assert json.loads((tmp_path / "eval.json").read_text())["tasks"] == {"kept": {"kind": "perplexity", "loss": 1.0}}


def test_an_export_needs_a_task_named(run_dir: Path, capsys, tmp_path: Path) -> None:
    export = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(export)]) is None
    code, _, err = _eval(capsys, str(export))
    assert code == 2 and "no validation split" in err and "data.path=" in err


def test_eval_help_does_not_import_torch() -> None:
    probe = ("import sys\nfrom llmtrain.cli import main\ntry:\n    main(['eval', '--help'])\n"
             "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"
    assert torch is not None  # (torch itself is fine in the test process)


def test_a_run_trained_with_eval_tasks_is_evaluated_on_them(tmp_path: Path, held_out: Path) -> None:
    """No task named: the run's own eval.tasks, perplexity:validation included (read later, with the data)."""
    import yaml

    from llmtrain.config.schema import config_to_dict
    from llmtrain.evaluation.plan import plan, saved_config

    run = tmp_path / "run"
    run.mkdir()
    trained = tiny_config(run, **{"eval.tasks": [f"perplexity:{held_out}", "perplexity:validation"]})
    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(trained)))
    chosen = plan(run, tiny_config(tmp_path / "cli"), data_named=False, harness_entries=[])
    assert [s.spec.name for s in chosen.sources] == [f"perplexity:{held_out}"]
    assert chosen.validation_of == saved_config(run) and "the run's own eval.tasks" in chosen.notes[0]
    named = plan(run, tiny_config(tmp_path / "cli", **{"eval.tasks": ["perplexity:validation"]}), False, [])
    assert named.sources == [] and named.validation_of is not None and named.notes == []


def test_options_may_come_between_overrides_and_a_file_in_the_out_path_is_refused_first(
        run_dir: Path, held_out: Path, capsys, tmp_path: Path) -> None:
    code, _, err = _eval(capsys, str(run_dir), "--device", "cpu", f"eval.tasks=[perplexity:{held_out}]",
                         "--out", str(tmp_path / "r"), "eval.batch_size=2")
    assert code == 0, err
    assert json.loads((tmp_path / "r" / "eval.json").read_text())["tasks"][f"perplexity:{held_out}"]["model"] == str(
        run_dir.resolve())
    code, _, err = _eval(capsys, str(run_dir), "--out", str(held_out / "sub"))
    assert code == 2 and f"'{held_out}' is a file" in err


def test_a_run_s_own_tasks_are_read_with_its_own_settings(tmp_path: Path) -> None:
    """A run trained on perplexity of .jsonl documents in field 'body' is evaluated with that field."""
    import yaml

    from llmtrain.config.schema import config_to_dict
    from llmtrain.evaluation.plan import plan

    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"body": "some held-out text"}) + "\n")
    run = tmp_path / "run"
    run.mkdir()
    trained = tiny_config(run, **{"eval.tasks": [f"perplexity:{docs}"], "eval.text_field": "body", "eval.limit": 5})
    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(trained)))
    chosen = plan(run, tiny_config(tmp_path / "cli"), data_named=False, harness_entries=[])
    assert chosen.settings.text_field == "body" and chosen.settings.limit is None  # whole files, not training's limit
    assert [s.spec.name for s in chosen.sources] == [f"perplexity:{docs}"]
    limited = plan(run, tiny_config(tmp_path / "cli", **{"eval.limit": 2}), False, [], frozenset({"limit"}))
    assert limited.settings.limit == 2
