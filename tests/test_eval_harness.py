"""The lm-evaluation-harness adapter (llmtrain/evaluation/harness.py) on a tiny model: its answers
against direct computations and against llmtrain's own tasks on the same data, and its errors.
Every task here is local (a YAML written into tmp_path over a JSON-lines file): nothing downloads."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from llmtrain.config.eval_tasks import TaskSpec  # noqa: E402
from llmtrain.config.schema import EvalConfig, ModelConfig  # noqa: E402
from llmtrain.core.errors import UserError  # noqa: E402
from llmtrain.data.tokenizers import ByteTokenizer  # noqa: E402
from llmtrain.evaluation import harness  # noqa: E402
from llmtrain.evaluation.harness import HarnessTask, ScorerLM, check_tasks  # noqa: E402
from llmtrain.evaluation.multiple_choice import read_multiple_choice  # noqa: E402
from llmtrain.evaluation.perplexity import read_perplexity  # noqa: E402
from llmtrain.evaluation.scoring import Scorer  # noqa: E402
from llmtrain.generation import generate  # noqa: E402
from llmtrain.model import GPT  # noqa: E402

WINDOW = 32
TOKENIZER = ByteTokenizer()
EOS = TOKENIZER.eos_id
EXAMPLES = [  # endings of different lengths, so the summed and the per-character choice differ
    {"ctx": "The cat sat", "endings": ["on the mat.", "up.", "in a very large hat today."], "label": 0},
    {"ctx": "A man is", "endings": ["running.", "a dog.", "sitting down on a bench"], "label": 2},
    {"ctx": "She opened the", "endings": ["door", "window wide", "box"], "label": 1},
    {"ctx": "Rain fell on", "endings": ["the town all night", "us", "roofs"], "label": 0},
    {"ctx": "He wrote a", "endings": ["letter", "long novel about the sea", "song"], "label": 1},
    {"ctx": "The dog ate", "endings": ["its food quickly", "a shoe", "nothing"], "label": 2},
    {"ctx": "We went to", "endings": ["the park", "bed", "a faraway island"], "label": 0},
    {"ctx": "Birds fly", "endings": ["south", "over the tall hills in spring", "away"], "label": 1},
    # longer than the window with its ending: cut from the left by both scorers
    {"ctx": "Once upon a time in a land far away there lived a", "endings": ["king", "small dragon", "cat"],
     "label": 1},
]
TASK_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: "{{{{endings}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


ROLLING_YAML = """\
task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
"""
DOCUMENTS = ["the quick brown fox jumps over the lazy dog " * 3, "hello world, this is a test.", "short"]


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=WINDOW), TOKENIZER.vocab_size).eval()


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tasks/: tiny_mc over mc.jsonl, tiny_rolling over documents.jsonl, and missing_data over a file
    that is not there."""
    root = tmp_path_factory.mktemp("harness")
    data = root / "mc.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    folder = root / "tasks"
    folder.mkdir()
    (folder / "tiny_mc.yaml").write_text(TASK_YAML.format(name="tiny_mc", data=data))
    (folder / "missing_data.yaml").write_text(TASK_YAML.format(name="missing_data", data=root / "absent.jsonl"))
    documents = root / "documents.jsonl"
    documents.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCUMENTS))
    (folder / "tiny_rolling.yaml").write_text(ROLLING_YAML.format(data=documents))
    return folder


def lm(model: GPT, **kwargs) -> ScorerLM:
    return ScorerLM(Scorer(model, WINDOW, batch_size=4), TOKENIZER, EOS, WINDOW, **kwargs)


def instances(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0, metadata=("t", i, 1))
            for i, a in enumerate(arguments)]


def test_harness_task_equals_builtin_multiple_choice(model: GPT, task_folder: Path) -> None:
    """acc and acc_norm of the harness's multiple_choice (through ScorerLM) are those of
    multiple_choice:FILE on the same lines; the harness leaves the global random state alone."""
    cfg = EvalConfig(harness_include=str(task_folder))
    scorer = Scorer(model, WINDOW, batch_size=4)
    notes: list[str] = []
    builtin = read_multiple_choice(TaskSpec("multiple_choice", str(task_folder.parent / "mc.jsonl"), "mc"), cfg)
    reference = builtin.encode(TOKENIZER, WINDOW, EOS, True, notes.append).run(scorer)
    assert reference["acc"] != reference["acc_norm"]  # the data tells the two apart

    check_tasks(["tiny_mc"], cfg.harness_include)
    task = HarnessTask(TaskSpec("harness", "tiny_mc", "harness:tiny_mc"), cfg).encode(
        TOKENIZER, WINDOW, EOS, True, notes.append)
    torch.manual_seed(7)
    metrics = task.run(scorer)
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(3))  # simple_evaluate's seeding was undone

    assert metrics["acc"] == reference["acc"] and metrics["acc_norm"] == reference["acc_norm"]
    assert metrics["acc_stderr"] == pytest.approx(reference["acc_stderr"], rel=1e-9)
    assert metrics["examples"] == len(EXAMPLES)
    assert task.size == sum(len(e["endings"]) for e in EXAMPLES)  # requests scored: the next run's progress total
    assert notes[-1].startswith("harness:tiny_mc: 6 of 27 requests' contexts are longer than the model's window"), notes
    raw = task.raw_results
    assert raw["results"]["tiny_mc"]["acc,none"] == metrics["acc"]
    assert json.loads(json.dumps(raw)) == raw  # JSON as the harness writes it


def test_harness_rolling_task_equals_builtin_perplexity(model: GPT, task_folder: Path) -> None:
    """A loglikelihood_rolling task's bits_per_byte is perplexity:FILE's on the same JSON lines."""
    cfg = EvalConfig(harness_include=str(task_folder))
    scorer = Scorer(model, WINDOW, batch_size=4)
    path = task_folder.parent / "documents.jsonl"
    found = read_perplexity(TaskSpec("perplexity", str(path), f"perplexity:{path}"), cfg).encode(
        TOKENIZER, WINDOW, EOS, True, print).run(scorer)
    task = HarnessTask(TaskSpec("harness", "tiny_rolling", "harness:tiny_rolling"), cfg)
    metrics = task.encode(TOKENIZER, WINDOW, EOS, True, print).run(scorer)
    assert found["documents"] == metrics["examples"] == len(DOCUMENTS)
    assert metrics["bits_per_byte"] == pytest.approx(found["bits_per_byte"], rel=1e-9)
    assert metrics["byte_perplexity"] == pytest.approx(found["perplexity"], rel=1e-9)  # bytes are the tokens here


def test_truncate_false_refuses_a_long_context(model: GPT, task_folder: Path) -> None:
    cfg = EvalConfig(harness_include=str(task_folder), truncate=False)
    task = HarnessTask(TaskSpec("harness", "tiny_mc", "harness:tiny_mc"), cfg).encode(
        TOKENIZER, WINDOW, EOS, False, print)
    with pytest.raises(UserError, match=r"harness:tiny_mc \(tiny_mc, document 0\): the model would read 37 tokens"
                                        r".*eval.truncate=false"):
        task.run(Scorer(model, WINDOW))


def test_loglikelihood_equals_a_direct_computation(model: GPT) -> None:
    pairs = [("The cat", " sat down"), ("", "Hello"), ("ab ", "cd"), ("x" * 40, " long context")]
    answers = lm(model).loglikelihood(instances("loglikelihood", pairs))
    for (context, continuation), (logprob, greedy) in zip(pairs, answers):
        stripped = context.rstrip(" ")  # the harness's encoding: trailing spaces go to the continuation
        continuation = context[len(stripped):] + continuation
        ctx = TOKENIZER.encode(stripped) if stripped else [EOS]
        cont = TOKENIZER.encode(continuation)
        whole = (ctx + cont)[-(WINDOW + 1):]
        with torch.no_grad():
            logits = model(torch.tensor([whole[:-1]]))[0, -len(cont):].double().log_softmax(-1)
        target = torch.tensor(cont)
        assert logprob == pytest.approx(float(logits[torch.arange(len(cont)), target].sum()), abs=1e-5)
        assert greedy == bool((logits.argmax(-1) == target).all())


def test_loglikelihood_rolling_equals_the_perplexity_task(model: GPT, tmp_path: Path) -> None:
    text = "the quick brown fox jumps over the lazy dog and runs far away into the hills " * 2
    path = tmp_path / "held_out.txt"
    path.write_text(text)
    spec = TaskSpec("perplexity", str(path), f"perplexity:{path}")
    scorer = Scorer(model, WINDOW, batch_size=4)
    for stride in (None, 8):
        cfg = EvalConfig(stride=stride)
        found = read_perplexity(spec, cfg).encode(TOKENIZER, WINDOW, EOS, True, print).run(scorer)
        adapter = lm(model, stride=stride)
        (total,) = adapter.loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]))
        assert total == pytest.approx(-found["loss"] * found["tokens"], rel=1e-6)
        assert found["tokens"] == len(text)
    # documents scored separately, in one call: each sum is the document's own
    short, long = "a few words", text
    both = lm(model).loglikelihood_rolling(instances("loglikelihood_rolling", [(short,), (long,)]))
    alone = [lm(model).loglikelihood_rolling(instances("loglikelihood_rolling", [(t,)]))[0] for t in (short, long)]
    assert both == pytest.approx(alone, rel=1e-6)


def test_generate_until_stops_at_the_until_string_and_matches_greedy_generate(model: GPT) -> None:
    prompt = "Once upon a "
    ids = generate(model, TOKENIZER.encode(prompt), 40, temperature=0, context=WINDOW,
                   vocab_limit=TOKENIZER.vocab_size, stop_id=EOS)
    reference = TOKENIZER.decode(ids)
    until = reference[20:22]
    expected = reference[:reference.find(until)]
    adapter = lm(model)
    out = adapter.generate_until(instances("generate_until", [
        (prompt, {"until": [until], "max_gen_toks": 40}),
        (prompt, {"until": "\x00never", "max_gen_toks": 40}),  # no stop: max_gen_toks tokens, one string
        ("y" * 40 + prompt, {"until": ["\x00never"], "max_gen_toks": 5}),  # context cut to the window
    ]))
    assert out[0] == expected and len(expected) >= 1
    assert out[1] == reference
    long_ids = TOKENIZER.encode("y" * 40 + prompt)
    assert out[2] == TOKENIZER.decode(generate(model, long_ids, 5, temperature=0, context=WINDOW,
                                               vocab_limit=TOKENIZER.vocab_size, stop_id=EOS))
    assert adapter.cut == 1 and adapter.scored == 3

    sampled = [lm(model).generate_until(
        instances("generate_until", [(prompt, {"do_sample": True, "max_gen_toks": 12})])) for _ in range(2)]
    assert sampled[0] == sampled[1]  # seeded
    assert model.training is False


def test_missing_lm_eval_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    with pytest.raises(UserError, match=r"not installed.*pip install 'llmtrain\[eval\]'"):
        check_tasks(["hellaswag"], None)


def test_include_path_must_be_a_folder(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"eval.harness_include=.*does not exist"):
        check_tasks(["tiny_mc"], str(tmp_path / "nowhere"))
    (tmp_path / "file.yaml").write_text("task: x\n")
    with pytest.raises(UserError, match=r"eval.harness_include=.*is a file"):
        check_tasks(["tiny_mc"], str(tmp_path / "file.yaml"))


def test_unknown_task_names_close_ones_and_the_include_folder(
    task_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bundled index takes ~15 s to build; here the folder's own index stands in for it (the
    # real one: test_unknown_bundled_task_suggests_its_neighbour, slow).
    folder = str(task_folder.resolve())
    own = harness._manager(folder, include_defaults=False)
    monkeypatch.setitem(harness._MANAGERS, (folder, True), own)
    with pytest.raises(UserError) as caught:
        check_tasks(["tiny_mcq"], folder)
    message = str(caught.value)
    assert "no task, group or tag named 'tiny_mcq' (close names: tiny_mc)" in message
    assert f"eval.harness_include={folder} adds 3 name(s) (missing_data, tiny_mc, tiny_rolling)" in message


def test_task_whose_data_is_missing_is_one_paragraph(model: GPT, task_folder: Path) -> None:
    cfg = EvalConfig(harness_include=str(task_folder))
    check_tasks(["missing_data"], cfg.harness_include)  # the name is known: its data is read when it runs
    task = HarnessTask(TaskSpec("harness", "missing_data", "harness:missing_data"), cfg)
    with pytest.raises(UserError) as caught:
        task.encode(TOKENIZER, WINDOW, EOS, True, print).run(Scorer(model, WINDOW))
    message = str(caught.value)
    assert message.startswith("'harness:missing_data': the lm-evaluation-harness could not prepare the task")
    assert "available locally" in message and "\n" not in message


@pytest.mark.slow
def test_unknown_bundled_task_suggests_its_neighbour() -> None:
    with pytest.raises(UserError, match=r"no task, group or tag named 'hellaswg' \(close names: hellaswag"):
        check_tasks(["hellaswg"], None)
    assert math.isfinite(harness.INDEX_SECONDS[(None, True)])
