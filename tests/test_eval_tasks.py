"""The built-in evaluation tasks (llmtrain/evaluation/tasks.py, perplexity.py, multiple_choice.py):
their numbers against computations done directly with the model, and their refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from llmtrain.config.eval_tasks import VALIDATION, TaskSpec, parse_task_specs
from llmtrain.config.schema import DataConfig, DataSource, EvalConfig, ModelConfig, TokenizerKind
from llmtrain.core.errors import UserError
from llmtrain.data.cache import PreparedData
from llmtrain.data.prepare import prepare_data
from llmtrain.data.tokenizers import ByteTokenizer, CharTokenizer
from llmtrain.evaluation.scoring import Scorer, rolling_requests
from llmtrain.evaluation.tasks import data_source, read_tasks, validation_source
from llmtrain.model import GPT

WINDOW = 32
BYTES = ByteTokenizer()


def tiny_gpt(vocab: int, seed: int = 0) -> GPT:
    # init std 0.1: the choices of the untrained model differ by >= 0.01 nats (an argmax is never
    # decided by float noise, ~2e-7 per token here), with logits small enough to stay precise.
    torch.manual_seed(seed)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=WINDOW, init_std=0.1), vocab)


def hand_logprob(model: GPT, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context) straight from the model: one forward, log_softmax, sum."""
    whole = [*context, *continuation][-(WINDOW + 1):]
    model.eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole[:-1]]))[0].float(), dim=-1)
    n = len(continuation)
    rows = range(len(whole) - 1 - n, len(whole) - 1)
    return float(sum(logp[r, t].double() for r, t in zip(rows, whole[-n:])))


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def one(entry: str, **eval_overrides: object):
    return read_tasks(parse_task_specs([entry]), EvalConfig(**eval_overrides))[0]


def encoded(entry: str, tokenizer=BYTES, window: int = WINDOW, truncate: bool = True, logs: list | None = None,
            **eval_overrides: object):
    log = logs.append if logs is not None else (lambda message: None)
    return one(entry, **eval_overrides).encode(tokenizer, window, tokenizer.eos_id, truncate, log)


MC_EXAMPLES = [
    {"ctx": "The cat sat on the", "endings": ["mat.", "quantum chromodynamics", "dog", "a"], "label": 0},
    {"ctx": "She opened the", "endings": ["door", "window slowly", "x"], "label": "2"},
    {"context": "1 2 3", "choices": ["4", "four five", "zzz"], "label": 1},
    {"ctx": "", "endings": ["Hello there.", "Hi"], "label": 1},
    {"ctx": "Water is ", "endings": ["wet", "dry and hot", "blue"], "label": 0},  # trailing space moves
    {"ctx": "ab", "endings": ["cd", "cdcdcdcd", "e"], "label": 2},
]


def test_multiple_choice_scores_equal_a_direct_computation_with_the_model(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "mc.jsonl", MC_EXAMPLES)
    model = tiny_gpt(256)
    task = encoded(f"multiple_choice:{path}")
    scores = Scorer(model, WINDOW, batch_size=8).loglikelihood(task.requests)
    picks = {"acc": [], "acc_norm": [], "acc_token": []}
    at = 0
    for example in MC_EXAMPLES:
        context = example.get("ctx", example.get("context"))
        endings = example.get("endings", example.get("choices"))
        lls, per_token = [], []
        for ending in endings:
            # lm-eval's pair: the context's trailing spaces go to the continuation " " + ending.
            ctx = context.rstrip(" ")
            cont = context[len(ctx):] + " " + ending
            ctx_ids = list(ctx.encode()) if ctx else [BYTES.eos_id]
            ll = hand_logprob(model, ctx_ids, list(cont.encode()))
            assert scores[at].logprob == pytest.approx(ll, abs=1e-5) and scores[at].tokens == len(cont.encode())
            lls.append(ll)
            per_token.append(ll / len(cont.encode()))
            at += 1
        label = int(example["label"])
        picks["acc"].append(lls.index(max(lls)) == label)
        picks["acc_norm"].append([ll / len(e) for ll, e in zip(lls, endings)].index(
            max(ll / len(e) for ll, e in zip(lls, endings))) == label)
        picks["acc_token"].append(per_token.index(max(per_token)) == label)
    metrics = task.run(Scorer(model, WINDOW, batch_size=8))
    n = len(MC_EXAMPLES)
    assert metrics["examples"] == n
    for name, hits in picks.items():
        p = sum(hits) / n
        assert metrics[name] == pytest.approx(p)
        assert metrics[f"{name}_stderr"] == pytest.approx(math.sqrt(p * (1 - p) * n / (n - 1)) / math.sqrt(n))
    # The three rules pick differently on this data: the test would notice one computed like another.
    assert len({tuple(h) for h in picks.values()}) == 3


def test_scores_do_not_depend_on_the_batch_size(tmp_path: Path) -> None:
    mc = encoded(f"multiple_choice:{write_jsonl(tmp_path / 'mc.jsonl', MC_EXAMPLES)}")
    text = tmp_path / "held_out.txt"
    text.write_text("Some held-out text that is longer than the window of the model, by a fair margin.\n" * 3)
    ppl = encoded(f"perplexity:{text}")
    model = tiny_gpt(256)
    small, large = Scorer(model, WINDOW, batch_size=1), Scorer(model, WINDOW, batch_size=8)
    one_by_one, batched = small.loglikelihood(mc.requests), large.loglikelihood(mc.requests)
    # Summed over an ending (tens of nats here): equal to float32 rounding, per token within 1e-6.
    assert max(abs(a.logprob - b.logprob) / a.tokens for a, b in zip(one_by_one, batched)) < 1e-6
    assert [a.tokens for a in one_by_one] == [b.tokens for b in batched]
    mc_small, mc_large = mc.run(small), mc.run(large)
    assert (mc_small["acc"], mc_small["acc_norm"]) == (mc_large["acc"], mc_large["acc_norm"])
    assert ppl.run(small)["loss"] == pytest.approx(ppl.run(large)["loss"], abs=1e-6)


def test_bits_per_byte_of_byte_tokens_is_the_loss_over_ln2(tmp_path: Path) -> None:
    text = "short document\n"
    (tmp_path / "a.txt").write_text(text)
    task = encoded(f"perplexity:{tmp_path / 'a.txt'}")
    model = tiny_gpt(256)
    metrics = task.run(Scorer(model, WINDOW))
    ids = list(text.encode())
    hand = hand_logprob(model, [BYTES.eos_id], ids)
    assert metrics["tokens"] == metrics["bytes"] == len(ids) and metrics["documents"] == 1
    assert metrics["loss"] == pytest.approx(-hand / len(ids), abs=1e-6)
    assert metrics["bits_per_byte"] == pytest.approx(metrics["loss"] / math.log(2), rel=1e-12)
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["loss"]))


def test_bits_per_byte_counts_the_utf8_bytes_not_the_tokens(tmp_path: Path) -> None:
    texts = ["héllo wörld ✓", "naïve café ☕ ok"]  # multi-byte characters: bytes > characters
    for i, t in enumerate(texts):
        (tmp_path / "held" / f"{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "held" / f"{i}.txt").write_text(t)
    chars = CharTokenizer.fit(set("".join(texts)))
    model = tiny_gpt(chars.vocab_size, seed=1)
    metrics = encoded(f"perplexity:{tmp_path / 'held'}", tokenizer=chars).run(Scorer(model, WINDOW))
    nats = -sum(hand_logprob(model, [chars.eos_id], chars.encode(t)) for t in texts)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    assert metrics["bytes"] == n_bytes > metrics["tokens"] == sum(map(len, texts))
    assert metrics["documents"] == 2
    assert metrics["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes, abs=1e-6)
    assert metrics["loss"] == pytest.approx(nats / sum(map(len, texts)), abs=1e-6)


def test_jsonl_documents_are_scored_each_on_its_own_and_empty_ones_skipped(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"body": "first doc"}, {"body": ""}, "", {"body": "second"}])
    model = tiny_gpt(256)
    metrics = encoded(f"perplexity:{path}", text_field="body").run(Scorer(model, WINDOW))
    nats = -sum(hand_logprob(model, [BYTES.eos_id], list(t.encode())) for t in ("first doc", "second"))
    assert metrics["documents"] == 2 and metrics["tokens"] == len("first doc") + len("second")
    assert metrics["loss"] == pytest.approx(nats / metrics["tokens"], abs=1e-6)


def test_a_stride_gives_more_context_and_still_scores_every_token_once(tmp_path: Path) -> None:
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(6))
    (tmp_path / "long.txt").write_text(text)
    model = tiny_gpt(256)
    plain = encoded(f"perplexity:{tmp_path / 'long.txt'}")
    strided = encoded(f"perplexity:{tmp_path / 'long.txt'}", stride=4)
    assert strided.size > plain.size  # more windows
    done: list[int] = []
    a, b = plain.run(Scorer(model, WINDOW)), strided.run(Scorer(model, WINDOW), done.append)
    assert sum(done) == strided.size  # the progress bar reaches its end
    assert a["tokens"] == b["tokens"] == len(text.encode())
    assert a["loss"] != pytest.approx(b["loss"], abs=1e-4)
    # Non-overlapping windows by hand: each predicts up to WINDOW tokens, the first from end-of-text.
    ids = list(text.encode())
    nats = -sum(hand_logprob(model, c, t) for c, t in rolling_requests(ids, BYTES.eos_id, WINDOW))
    assert a["loss"] == pytest.approx(nats / len(ids), abs=1e-6)
    with pytest.raises(UserError, match=r"'eval.stride' is 40, more than the model's window of 32 tokens"):
        encoded(f"perplexity:{tmp_path / 'long.txt'}", stride=40)


BAD_LINES = [
    ("{not json", r"mc.jsonl:2 is not valid JSON"),
    ("[1, 2]", r"mc.jsonl:2 is an array, not a JSON object"),
    ({"ctx": "a", "label": 0}, r"mc.jsonl:2 has no field 'endings' or 'choices' \(it has: ctx, label\)"),
    ({"endings": ["a", "b"], "label": 0}, r"mc.jsonl:2 has no field 'ctx' or 'context' \(it has: endings, label\)"),
    ({"ctx": "a", "endings": ["a", "b"]}, r"mc.jsonl:2 has no field 'label'"),
    ({"ctx": "a", "endings": "a b", "label": 0},
     r"mc.jsonl:2: the endings must be a list of at least 2 strings.*\"a b\""),
    ({"ctx": "a", "endings": ["only"], "label": 0},
     r"mc.jsonl:2: the endings must be a list of at least 2.*\[\"only\"\]"),
    ({"ctx": "a", "endings": ["x", 3], "label": 0}, r"mc.jsonl:2: the endings must be .*\[\"x\", 3\]"),
    ({"ctx": "a", "endings": ["x", ""], "label": 0}, r"mc.jsonl:2: ending 1 is empty"),
    ({"ctx": "a", "endings": ["x", "y", "z"], "label": 3}, r"mc.jsonl:2: the label 3 is out of range: .* 3 endings, so "
                                                          r"the label must be 0 to 2"),
    ({"ctx": "a", "endings": ["x", "y"], "label": "-1"}, r"mc.jsonl:2: the label -1 is out of range.*0 to 1"),
    ({"ctx": "a", "endings": ["x", "y"], "label": "two"}, r"mc.jsonl:2: the label is \"two\", not an integer.*0 to 1"),
    ({"ctx": "a", "endings": ["x", "y"], "label": 1.5}, r"mc.jsonl:2: the label is 1.5, not an integer"),
    ({"ctx": "a", "endings": ["x", "y"], "label": True}, r"mc.jsonl:2: the label is true, not an integer"),
    ({"ctx": 5, "endings": ["x", "y"], "label": 0}, r"mc.jsonl:2: the context is the number 5, not a string"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_LINES)
def test_a_bad_multiple_choice_line_is_named_with_its_value(tmp_path: Path, bad, message: str) -> None:
    path = write_jsonl(tmp_path / "mc.jsonl", [MC_EXAMPLES[0], bad, MC_EXAMPLES[1]])
    with pytest.raises(UserError, match=message):
        one(f"multiple_choice:{path}")


def test_a_multiple_choice_file_with_nothing_to_score_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(UserError, match=r"empty.jsonl has no example"):
        one(f"multiple_choice:{tmp_path / 'empty.jsonl'}")
    with pytest.raises(UserError, match=r"absent.jsonl does not exist"):
        one(f"multiple_choice:{tmp_path / 'absent.jsonl'}")


def test_a_character_the_char_tokenizer_never_saw_is_named(tmp_path: Path) -> None:
    chars = CharTokenizer.fit(set("abcdefghijklmnopqrstuvwxyz .,"))
    path = write_jsonl(tmp_path / "mc.jsonl", [{"ctx": "a cat", "endings": ["sat", "ran"], "label": 0},
                                               {"ctx": "a dog", "endings": ["sat", "ran!"], "label": 0}])
    with pytest.raises(UserError, match=r"mc.jsonl:2: character '!' is not in this char tokenizer's vocabulary"):
        encoded(f"multiple_choice:{path}", tokenizer=chars)
    (tmp_path / "held.txt").write_text("plain words, then Ω")
    with pytest.raises(UserError, match=r"held.txt: character 'Ω' is not in"):
        encoded(f"perplexity:{tmp_path / 'held.txt'}", tokenizer=chars)


def test_long_contexts_are_cut_and_said_once_or_refused(tmp_path: Path) -> None:
    long = "x" * 60  # 60 byte tokens: longer than the window of 32
    path = write_jsonl(tmp_path / "mc.jsonl", [{"ctx": long, "endings": ["a", "bb"], "label": 0},
                                               {"ctx": "short", "endings": ["a", "bb"], "label": 1},
                                               {"ctx": long + "y", "endings": ["a", "bb"], "label": 1}])
    logs: list[str] = []
    task = encoded(f"multiple_choice:{path}", logs=logs)
    assert logs == [f"multiple_choice:{path}: 2 of 3 examples' contexts are longer than the model's window of "
                    "32 tokens and are cut from the left; eval.truncate=false refuses them instead"]
    scores = Scorer(tiny_gpt(256), WINDOW).loglikelihood(task.requests)
    assert [s.truncated for s in scores] == [True, True, False, False, True, True]
    with pytest.raises(UserError, match=r"mc.jsonl:1: the context and its longest ending are 63 tokens; the model "
                                        r"reads at most 33 .*eval.truncate=false"):
        encoded(f"multiple_choice:{path}", truncate=False)
    too_long = write_jsonl(tmp_path / "long_ending.jsonl", [{"ctx": "a", "endings": ["b", "y" * 40], "label": 0}])
    with pytest.raises(UserError, match=r"long_ending.jsonl:1: ending 1 \(\"y+\"\) is 41 tokens, longer than the "
                                        r"model's window of 32"):
        encoded(f"multiple_choice:{too_long}")


def test_a_perplexity_file_long_beyond_the_window_says_nothing(tmp_path: Path) -> None:
    (tmp_path / "long.txt").write_text("y" * 200)
    logs: list[str] = []
    assert encoded(f"perplexity:{tmp_path / 'long.txt'}", logs=logs).size == 7 and logs == []


def test_limit_takes_the_first_examples_and_documents(tmp_path: Path) -> None:
    mc = write_jsonl(tmp_path / "mc.jsonl", [*MC_EXAMPLES, "{broken after the limit"])
    task = encoded(f"multiple_choice:{mc}", limit=2)
    assert [e.where for e in task.examples] == [f"{mc}:1", f"{mc}:2"]
    assert task.run(Scorer(tiny_gpt(256), WINDOW))["examples"] == 2
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"document {i}"} for i in range(5)])
    metrics = encoded(f"perplexity:{docs}", limit=3).run(Scorer(tiny_gpt(256), WINDOW))
    assert metrics["documents"] == 3 and metrics["tokens"] == 3 * len("document 0")


def test_perplexity_inputs_that_give_nothing_are_named(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"'perplexity:.*absent.txt': .*absent.txt does not exist"):
        one(f"perplexity:{tmp_path / 'absent.txt'}")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match=r"empty.txt is empty; give held-out text"):
        one(f"perplexity:{tmp_path / 'empty.txt'}")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "data.bin").write_bytes(b"\x00")
    with pytest.raises(UserError,
                       match=r"folder has no .txt, .md, .text or .jsonl file with text in it \(searched recursively\)"):
        one(f"perplexity:{tmp_path / 'folder'}")
    with pytest.raises(UserError, match=r"matches no file"):
        one(f"perplexity:{tmp_path / '*.nothing'}")
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(UserError, match=r"blank.jsonl holds no text \(every document in it is empty\)"):
        one(f"perplexity:{blank}")
    bad = write_jsonl(tmp_path / "docs.jsonl", [{"text": "ok"}, {"content": "no text field"}])
    with pytest.raises(UserError, match=r"docs.jsonl:2 has no string field 'text' \(it has: content\); set "
                                        r"eval.text_field"):
        one(f"perplexity:{bad}")


def test_undecodable_bytes_are_read_as_data_preparation_reads_them(tmp_path: Path) -> None:
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait")  # Latin-1, not UTF-8
    logs: list[str] = []
    task = encoded(f"perplexity:{tmp_path / 'bad.txt'}", logs=logs)
    assert len(logs) == 1 and "1 document(s) are not valid UTF-8" in logs[0]
    assert task.total_bytes == len("caf\ufffd au lait".encode())  # the text as read: U+FFFD is 3 bytes


def test_task_entries_are_checked_before_any_file_is_read() -> None:
    for entry, message in [("perplexity", r"names the kind but no PATH: write perplexity:PATH"),
                           ("ppl:held.txt", r"unknown kind 'ppl' \(did you mean perplexity:held.txt\?\)"),
                           ("multiple-choice:mc.jsonl", r"did you mean multiple_choice:mc.jsonl"),
                           ("harness:", r"has no TASK after the colon"),
                           ("held.txt", r"has no kind: write perplexity:held.txt")]:
        with pytest.raises(UserError, match=message) as err:
            parse_task_specs([entry], key="eval.tasks")
        assert f"'{entry}'" in str(err.value) and "'eval.tasks'" in str(err.value)
    with pytest.raises(UserError, match=r"'perplexity:a.txt' is given twice"):
        parse_task_specs(["perplexity:a.txt", "perplexity:a.txt"])
    specs = parse_task_specs(["perplexity:~/held.txt", "harness:arc_easy", "perplexity:validation"])
    assert specs[0] == TaskSpec("perplexity", str(Path("~/held.txt").expanduser()), "perplexity:~/held.txt")
    assert specs[1] == TaskSpec("harness", "arc_easy", "harness:arc_easy") and specs[2] == VALIDATION


def _prepared(tmp_path: Path, tokenizer: TokenizerKind) -> PreparedData:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(12):
        (folder / f"doc{i}.txt").write_text(f"Document {i}. " + "some words here and there. " * (1 + i % 3))
    cfg = DataConfig(source=DataSource.text, path=str(folder), tokenizer=tokenizer, val_fraction=0.5,
                     cache_dir=str(tmp_path / "cache"))
    return prepare_data(cfg, log=lambda m: None)


def test_the_validation_split_is_its_documents_scored_as_held_out_text(tmp_path: Path) -> None:
    data = _prepared(tmp_path, TokenizerKind.char)
    tokenizer = data.tokenizer()
    model = tiny_gpt(tokenizer.vocab_size)
    source = read_tasks([VALIDATION], EvalConfig(), data=data)[0]
    metrics = source.encode(tokenizer, WINDOW, tokenizer.eos_id, True, print).run(Scorer(model, WINDOW, batch_size=3))
    # By hand: the val stream cut at end-of-text, each document predicted from end-of-text on.
    stream = np.asarray(data.tokens("val")).tolist()
    documents, current = [], []
    for token in stream:
        if token == tokenizer.eos_id:
            documents.append(current)
            current = []
        else:
            current.append(token)
    assert current == [] and len(documents) == data.meta["val_documents"] >= 2
    nats = -sum(hand_logprob(model, c, t) for d in documents for c, t in rolling_requests(d, tokenizer.eos_id, WINDOW))
    n_tokens = sum(map(len, documents))
    assert metrics["documents"] == len(documents) and metrics["tokens"] == n_tokens
    assert metrics["loss"] == pytest.approx(nats / n_tokens, abs=1e-6)
    n_bytes = sum(len(tokenizer.decode(d).encode()) for d in documents)
    assert metrics["bytes"] == n_bytes and metrics["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes)
    assert validation_source(data, EvalConfig(limit=1)).encode(tokenizer, WINDOW, tokenizer.eos_id, True,
                                                               print).run(Scorer(model, WINDOW))["documents"] == 1


def test_a_validation_split_that_cannot_be_scored_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(UserError,
                       match=r"instruction data.*name a held-out file instead: eval.tasks=\[perplexity:FILE\]"):
        validation_source(PreparedData(tmp_path, {"loss_mask": True, "val_tokens": 10}))
    with pytest.raises(UserError, match=r"validation split has no tokens.*data=text data.path=FILE"):
        validation_source(PreparedData(tmp_path, {"val_tokens": 0}))
    with pytest.raises(UserError, match=r"'perplexity:validation' is the run's own validation split"):
        read_tasks([VALIDATION], EvalConfig())


def test_data_on_the_command_line_is_scored_as_its_whole_text(tmp_path: Path) -> None:
    (tmp_path / "held.txt").write_text("held-out words\n")
    model = tiny_gpt(256)
    source = data_source(DataConfig(source=DataSource.text, path=str(tmp_path / "held.txt")))
    assert source.spec.name == f"perplexity:{tmp_path / 'held.txt'}"
    metrics = source.encode(BYTES, WINDOW, BYTES.eos_id, True, print).run(Scorer(model, WINDOW))
    assert metrics == encoded(f"perplexity:{tmp_path / 'held.txt'}").run(Scorer(model, WINDOW))
    with pytest.raises(UserError, match=r"data=python_stdlib cannot be evaluated as held-out text: give data=text"):
        data_source(DataConfig())


class DroppingTokenizer:
    """Like an exported char tokenizer in transformers: characters it does not know are dropped."""

    def __init__(self, alphabet: str) -> None:
        self.index = {c: i for i, c in enumerate(alphabet)}
        self.vocab_size, self.eos_id = len(alphabet) + 1, len(alphabet)

    def encode(self, text: str) -> list[int]:
        return [self.index[c] for c in text if c in self.index]

    def decode(self, ids: list[int]) -> str:
        return "".join(next(c for c, i in self.index.items() if i == t) for t in ids if t != self.eos_id)


def test_trailing_whitespace_of_a_context_moves_to_the_continuation_as_in_the_harness() -> None:
    from llmtrain.evaluation.scoring import encode_pair

    context, continuation = encode_pair(BYTES, "def f():\n\t", "return", BYTES.eos_id)
    assert context == list(b"def f():") and continuation == list(b"\n\treturn")
    # a context the tokenizer drops entirely is no context: end-of-text stands in for it
    dropping = DroppingTokenizer("abc ")
    assert encode_pair(dropping, "\u20ac\u20ac", " abc", dropping.eos_id) == (
        [dropping.eos_id], dropping.encode(" abc"))


def test_text_that_encodes_to_no_tokens_is_refused_not_divided_by_zero(tmp_path: Path) -> None:
    held = tmp_path / "unknown.txt"
    held.write_text("\u20ac\u20ac\r\r")
    dropping = DroppingTokenizer("abc ")
    task = encoded(f"perplexity:{held}", tokenizer=dropping)
    with pytest.raises(UserError, match="no tokens at all"):
        task.run(Scorer(tiny_gpt(dropping.vocab_size), WINDOW))
