"""eval.tasks during `llmtrain train`: the tasks' records at every evaluation (equal to scoring the
final weights afterwards), training unchanged by them, a resume with other tasks, the dashboards'
tags, the report's plot and Evaluation section, and bad tasks refused before any work."""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from rich.console import Console

from llmtrain.checkpoint.layout import step_dir_name
from llmtrain.config.derived import seq_len_of
from llmtrain.config.eval_tasks import parse_task_specs
from llmtrain.config.schema import ModelConfig
from llmtrain.core.errors import UserError
from llmtrain.data.tokenizers import load_tokenizer
from llmtrain.engine.state import TrainResult
from llmtrain.evaluation.scoring import Scorer
from llmtrain.evaluation.tasks import read_tasks
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.metrics.writer import scalars
from llmtrain.model import GPT
from llmtrain.runs.report import write_report
from llmtrain.runs.report.render import render_summary
from llmtrain.training.evaluator import Evaluator
from llmtrain.training.loop import train

from .conftest import TINY_CORPUS, run_cli, tiny_config

STEPS, INTERVAL = 10, 5


def task_files(folder: Path) -> list[str]:
    """A held-out text and a 6-example multiple-choice file, in the corpus's characters (the run's
    char tokenizer knows no others)."""
    text = TINY_CORPUS.read_text()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "held.txt").write_text(text[-1500:])
    examples = [{"ctx": text[i * 200:i * 200 + 60], "endings": [text[i * 200 + 60:i * 200 + 90],
                 text[i * 300 + 5:i * 300 + 35], text[i * 100 + 7:i * 100 + 30]], "label": i % 3} for i in range(6)]
    (folder / "mc.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    return [f"perplexity:{folder / 'held.txt'}", f"multiple_choice:{folder / 'mc.jsonl'}"]


def eval_task_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "eval_task"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same 10-step run with the two tasks (a checkpoint at step 5) and without them."""
    root = tmp_path_factory.mktemp("eval_training")
    tasks = task_files(root / "tasks")
    common = {"eval_interval": INTERVAL, "max_steps": STEPS, "model.dropout": 0.1}
    with_cfg = tiny_config(root / "with", **common, **{"eval.tasks": tasks, "checkpoint.every_steps": INTERVAL})
    with_tasks = train(with_cfg)
    without = train(tiny_config(root / "without", **common))
    return {"root": root, "tasks": tasks, "cfg": with_cfg, "with": with_tasks, "without": without}


@pytest.mark.slow  # two 10-step runs (~6 s), shared by the tests of the module
def test_every_evaluation_scores_every_task_as_the_final_weights_do(runs: dict) -> None:
    run_dir, cfg, tasks = runs["with"].run_dir, runs["cfg"], runs["tasks"]
    records = eval_task_records(run_dir)
    assert [(r["step"], r["task"]) for r in records] == [(s, t) for s in (INTERVAL, STEPS) for t in tasks]
    assert {"loss", "perplexity", "bits_per_byte", "tokens", "bytes"} <= set(records[0])
    assert {"acc", "acc_norm", "acc_stderr", "examples"} <= set(records[1])
    assert records[0]["loss"] != records[2]["loss"], "the model trained between the two evaluations"

    # The same tasks, scored afterwards on model.pt with the run's tokenizer and window.
    state = torch.load(run_dir / "model.pt", weights_only=True)
    model = GPT(cfg.model, state["wte.weight"].shape[0])
    model.load_state_dict(state)
    tokenizer = load_tokenizer(run_dir / "tokenizer.json")
    window = seq_len_of(cfg)
    scorer = Scorer(model, window, cfg.eval.batch_size)
    for source, record in zip(read_tasks(parse_task_specs(tasks), cfg.eval), records[2:]):
        metrics = source.encode(tokenizer, window, tokenizer.eos_id, True, lambda message: None).run(scorer)
        assert {k: record[k] for k in metrics} == pytest.approx(metrics, rel=1e-12, abs=1e-12), source.spec.name


@pytest.mark.slow
def test_the_tasks_do_not_change_training(runs: dict) -> None:
    """Dropout on: a task that drew from torch's generator would change every later step's loss."""
    with_tasks, without = runs["with"], runs["without"]
    assert with_tasks.train_losses == without.train_losses
    assert with_tasks.val_losses == without.val_losses
    assert not eval_task_records(without.run_dir)


@pytest.mark.slow
def test_a_resume_with_other_tasks_evaluates_those(runs: dict) -> None:
    """eval.tasks is no shape key: the step-5 checkpoint resumes with one task less, and its step-10
    score is the uninterrupted run's."""
    cfg = tiny_config(runs["root"] / "resumed", eval_interval=INTERVAL, max_steps=STEPS, **{
        "model.dropout": 0.1, "eval.tasks": runs["tasks"][1:],
        "resume": str(runs["with"].run_dir / "checkpoints" / step_dir_name(INTERVAL))})
    resumed = train(cfg)
    records = eval_task_records(resumed.run_dir)
    assert [(r["step"], r["task"]) for r in records] == [(STEPS, runs["tasks"][1])]
    original = [r for r in eval_task_records(runs["with"].run_dir) if r["step"] == STEPS][1]
    assert records[0] == original
    assert resumed.train_losses == {s: v for s, v in runs["with"].train_losses.items() if s > INTERVAL}


@pytest.mark.slow
def test_the_report_plots_the_tasks_and_lists_eval_json(runs: dict) -> None:
    run_dir = runs["root"] / "report"
    shutil.copytree(runs["with"].run_dir, run_dir)
    eval_json = {"model": str(run_dir), "created": "2025-01-02T03:04:05+00:00", "tasks": {
        "perplexity:held.txt": {"kind": "perplexity", "loss": 1.234, "perplexity": 3.435, "bits_per_byte": 1.78,
                                "tokens": 1500, "bytes": 1500, "documents": 1},
        "multiple_choice:mc.jsonl": {"kind": "multiple_choice", "acc": 0.5, "acc_stderr": 0.2236, "acc_norm": 0.25,
                                     "acc_norm_stderr": 0.1936, "examples": 6}}}
    (run_dir / "eval.json").write_text(json.dumps(eval_json))
    report = write_report(run_dir, inference=False)
    assert not (run_dir / "report" / "eval_tasks.png").exists()  # 2 evaluations: too few for a curve (issue 20)
    markdown = (run_dir / "report.md").read_text()
    section = markdown.split("## Evaluation")[1]
    assert "eval.json (`llmtrain eval`): 2 task(s)" in section and "written 2025-01-02T03:04:05+00:00" in section
    assert ("| perplexity:held.txt | perplexity | loss 1.2340, ppl 3.44, bits/byte 1.7800 | 1,500 tokens, 1,500 bytes, "
            "1 document |") in section
    assert ("| multiple_choice:mc.jsonl | multiple_choice | acc 0.5000 ± 0.2236, acc_norm 0.2500 ± 0.1936 "
            "| 6 examples |") in section
    step10 = [r for r in eval_task_records(run_dir) if r["step"] == STEPS]
    assert f"{runs['tasks'][0]} at step {STEPS}: loss {step10[0]['loss']:.4f}" in section
    assert "*eval_tasks.png: left out: only 2 evaluations of the tasks (at every evaluation: every eval_interval=5 " \
        "steps and at the end; this run took 10 steps): too few for a curve; eval_interval=2 gives 5*" in section
    page = (run_dir / "report.html").read_text()
    assert "<h2 id='evaluation'>Evaluation</h2>" in page and "acc 0.5000 ± 0.2236" in page
    console = Console(file=io.StringIO(), width=300)
    render_summary(report, console)
    assert ("evaluation: eval.json: perplexity:held.txt loss 1.2340, ppl 3.44, bits/byte 1.7800;"
            in console.file.getvalue())


class DrawingTask:
    """A task that draws from every global generator (as the harness seeds and draws), and takes time."""

    spec = parse_task_specs(["harness:drawing"])[0]
    size = 1

    def run(self, scorer: object, progress: object = None) -> dict[str, float]:
        time.sleep(0.05)
        return {"acc": float(torch.rand(()) + random.random() + np.random.rand() > 5)}


def test_an_evaluation_leaves_the_generators_and_the_monitor_clock_as_they_were(tmp_path: Path) -> None:
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32), 16)
    written, paused = [], []
    evaluator = Evaluator(eval_interval=INTERVAL, model=model, batches=[], device=torch.device("cpu"),
                          autocast=contextlib.nullcontext, dashboard=Dashboard(10, Console(file=io.StringIO())),
                          metrics=SimpleNamespace(write=written.append), result=TrainResult(tmp_path, 0, 0),
                          checkpointer=SimpleNamespace(evaluated=lambda step, loss: None),
                          monitor=SimpleNamespace(paused=paused.append, evaluated=lambda step, loss: None),
                          scorer=Scorer(model, 32),
                          tasks=[DrawingTask()])
    before = torch.rand(3), random.random(), np.random.rand()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    assert evaluator.maybe_run(INTERVAL - 1, forced=False) is False and not written
    assert evaluator.maybe_run(INTERVAL, forced=False) is True
    after = torch.rand(3), random.random(), np.random.rand()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    assert torch.equal(after[0], torch.rand(3)) and after[1:] == (random.random(), np.random.rand())
    assert not torch.equal(before[0], after[0])
    assert [r["kind"] for r in written] == ["eval", "eval_task"] and written[1]["task"] == "harness:drawing"
    assert len(paused) == 1 and paused[0] >= 0.05, "the evaluation's time is not training time"


def test_a_report_without_tasks_has_no_evaluation_section(tmp_path: Path) -> None:
    lines = [{"kind": "train", "step": s, "loss": 3.0} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    report = write_report(tmp_path, inference=False)
    assert report.evaluation is None and "## Evaluation" not in (tmp_path / "report.md").read_text()
    assert not (tmp_path / "report" / "eval_tasks.png").exists()


def test_task_records_become_one_dashboard_curve_per_task_and_metric() -> None:
    record = {"kind": "eval_task", "step": 5, "task": "multiple_choice:mc.jsonl", "acc": 0.5, "acc_norm": 0.25,
              "examples": 6}
    assert scalars(record) == {"eval_task/multiple_choice:mc.jsonl/acc": 0.5,
                               "eval_task/multiple_choice:mc.jsonl/acc_norm": 0.25,
                               "eval_task/multiple_choice:mc.jsonl/examples": 6.0}
    assert scalars({"kind": "eval", "step": 5, "val_loss": 2.0}) == {"eval/val_loss": 2.0}


def test_the_console_line_of_a_task_is_short() -> None:
    console = Console(file=io.StringIO(), width=200)
    sink = Dashboard(10, console)
    sink.log_eval_task({"kind": "eval_task", "step": 5, "task": "perplexity:held.txt", "loss": 1.234,
                        "perplexity": 3.4349, "bits_per_byte": 1.78, "tokens": 9, "bytes": 9, "documents": 1})
    sink.log_eval_task({"kind": "eval_task", "step": 5, "task": "multiple_choice:[x].jsonl", "acc": 0.5,
                        "acc_stderr": 0.2, "acc_norm": 0.25, "examples": 6})
    assert console.file.getvalue().splitlines() == [
        "eval step 5: perplexity:held.txt  loss 1.2340  ppl 3.43  bits/byte 1.7800",
        "eval step 5: multiple_choice:[x].jsonl  acc 0.5000  acc_norm 0.2500"]


BAD_TASKS = [
    pytest.param("mc:{dir}/mc.jsonl", ["'eval.tasks': the entry 'mc:", "unknown kind 'mc'",
                                       "did you mean multiple_choice:"], id="bad-entry"),
    pytest.param("perplexity:{dir}/missing.txt", ["missing.txt does not exist"], id="missing-file"),
    pytest.param("multiple_choice:{dir}/bad.jsonl", ["bad.jsonl:2: the label 7 is out of range"], id="bad-line"),
]


def bad_file(folder: Path) -> None:
    good = '{"ctx": "a", "endings": ["b", "c"], "label": 0}'
    (folder / "bad.jsonl").write_text(good + "\n" + good.replace('"label": 0', '"label": 7') + "\n")


@pytest.mark.parametrize("entry, expected", BAD_TASKS)
def test_a_bad_task_is_refused_before_any_work(tmp_path: Path, entry: str, expected: list[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    bad_file(tmp_path)
    cache = tmp_path / "cache"
    monkeypatch.setenv("LLMTRAIN_CACHE", str(cache))
    cfg = tiny_config(tmp_path / "run", eval_interval=INTERVAL, **{"eval.tasks": [entry.format(dir=tmp_path)],
                                                                  "data.cache_dir": str(cache)})
    with pytest.raises(UserError) as refused:
        train(cfg)
    for piece in expected:
        assert piece in str(refused.value), refused.value
    assert not (tmp_path / "run").exists(), "the run dir was made although the tasks were refused"
    assert not cache.exists(), "the data was prepared although the tasks were refused"


def test_the_cli_refuses_a_bad_task_file_in_one_paragraph(tmp_path: Path) -> None:
    bad_file(tmp_path)
    env = {"LLMTRAIN_CACHE": str(tmp_path / "cache"), "HYDRA_FULL_ERROR": None}
    proc = run_cli("train", "model=gpt_tiny", "max_steps=2", f"hydra.run.dir={tmp_path / 'run'}",
                   f"eval.tasks=[multiple_choice:{tmp_path / 'bad.jsonl'}]", cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [f"llmtrain: error: {tmp_path / 'bad.jsonl'}:2: the label 7 is out of "
                                                "range: this example has 2 endings, so the label must be 0 to 1."]
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
