"""Hostile files and folders on `llmtrain export` and `llmtrain eval` (issue 31): an export never
overwrites a folder that is not a previous export, in either format, and fails in one paragraph
with nothing changed; an eval task file that is a FIFO, a device, binary, nested, huge or one
enormous line is refused by name (never opened, never read whole); an unreadable eval.json is kept,
however many there are."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llmtrain.config.eval_tasks import parse_task_specs
from llmtrain.config.schema import EvalConfig
from llmtrain.core.errors import UserError
from llmtrain.data.tokenizers import ByteTokenizer
from llmtrain.evaluation import multiple_choice, perplexity
from llmtrain.evaluation.plan import saved_config
from llmtrain.evaluation.runner import write_results
from llmtrain.evaluation.scoring import Scorer, encode_pair
from llmtrain.evaluation.tasks import read_tasks
from llmtrain.hf.export import PARTIAL
from llmtrain.model import GPT
from llmtrain.runs.export import export_run
from llmtrain.training.loop import train

from ..conftest import TINY_CORPUS, run_cli, tiny_config
from ..test_cli_run import TINY

GOOD_LINE = {"ctx": "A man is", "endings": ["running.", "a dog."], "label": 0}


def hashes(folder: Path) -> dict[str, str]:
    """Every entry under `folder` (hidden ones too) with its content's sha256 ('' for a folder)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
            for p in sorted(folder.rglob("*"))}


def one_paragraph_refusal(proc, *named: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("llmtrain: error: ")
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    for text in named:
        assert text in proc.stderr, (text, proc.stderr)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run trained 3 steps (char tokens of the shipped corpus): read, never changed."""
    out = tmp_path_factory.mktemp("hostile_export_eval") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        train(tiny_config(out, max_steps=3, report=False))
    return out


@pytest.fixture
def make_fifo() -> Iterator[Callable[[Path], Path]]:
    """Makes named pipes. A writer keeps opening and closing each, so a reader that wrongly opens one
    gets end-of-file and the test fails instead of hanging forever."""
    made: list[Path] = []
    done = threading.Event()

    def unblock() -> None:
        while not done.wait(0.05):
            for path in list(made):
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:  # ENXIO: nobody is reading it, as it should be (or it was moved)
                    pass

    def make(path: Path) -> Path:
        os.mkfifo(path)
        made.append(path)
        return path

    thread = threading.Thread(target=unblock, daemon=True)
    thread.start()
    yield make
    done.set()
    thread.join()


@pytest.fixture
def fifo(tmp_path: Path, make_fifo: Callable[[Path], Path]) -> Path:
    return make_fifo(tmp_path / "tasks.jsonl")


# ---- export: one target check and one staged write for both formats ------------------------------

@pytest.mark.parametrize("fmt", ["llmtrain", "hf"])
def test_a_hugging_face_folder_as_out_is_refused_untouched(run_dir: Path, tmp_path: Path, fmt: str) -> None:
    """The tester's case: `export RUN --out HF_FOLDER` (llmtrain format) replaced its weights and tokenizer."""
    pytest.importorskip("transformers")
    from ..test_hf_init import save_gpt2

    folder = save_gpt2(tmp_path / "gpt2")
    before = hashes(tmp_path)
    proc = run_cli("export", str(run_dir), "--format", fmt, "--out", str(folder), cwd=tmp_path)
    one_paragraph_refusal(proc, str(folder), "holds a model this exporter did not write")
    assert hashes(tmp_path) == before


def test_either_format_replaces_a_previous_export_of_either(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    for fmt, marker in [("llmtrain", "model_config.json"), ("hf", "config.json"), ("llmtrain", "model_config.json")]:
        proc = run_cli("export", str(run_dir), "--format", fmt, "--out", str(out), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert (out / marker).is_file()
        assert ("config.json" in os.listdir(out)) == (fmt == "hf"), "the previous export was replaced whole"
    assert sorted(os.listdir(tmp_path)) == ["model"], "no staging folder left beside it"
    (out / "notes.txt").write_text("mine")
    before = hashes(tmp_path)
    for fmt in ("llmtrain", "hf"):
        one_paragraph_refusal(run_cli("export", str(run_dir), "--format", fmt, "--out", str(out), cwd=tmp_path),
                              "holds files an export does not write (notes.txt)")
    assert hashes(tmp_path) == before


@pytest.mark.parametrize("fmt", ["llmtrain", "hf"])
def test_a_regular_file_as_out_or_above_it_is_refused(run_dir: Path, tmp_path: Path, fmt: str) -> None:
    (tmp_path / "weights.bin").write_bytes(b"someone's file")
    before = hashes(tmp_path)
    one_paragraph_refusal(run_cli("export", str(run_dir), "--format", fmt, "--out", "weights.bin", cwd=tmp_path),
                          f"--out {tmp_path / 'weights.bin'} is a file")
    one_paragraph_refusal(run_cli("export", str(run_dir), "--format", fmt, "--out", "weights.bin/model",
                                  cwd=tmp_path), f"is inside {tmp_path / 'weights.bin'}, which is a file")
    assert hashes(tmp_path) == before


@pytest.mark.parametrize("fmt", ["llmtrain", "hf"])
def test_a_read_only_file_system_is_refused_before_the_model_loads(run_dir: Path, tmp_path: Path, fmt: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests run as root, whom permissions do not stop: os.access answers as on a read-only mount."""
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == tmp_path and mode & os.W_OK
                        else real_access(path, mode, **kw))
    monkeypatch.setattr("llmtrain.runs.export.load_run", lambda *a, **k: pytest.fail("the model was loaded"))
    proc = run_cli("export", str(run_dir), "--format", fmt, "--out", "new/model", cwd=tmp_path)
    one_paragraph_refusal(proc, f"{tmp_path} is not writable", "read-only file system")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fmt", ["llmtrain", "hf"])
def test_a_write_that_fails_read_only_changes_nothing(run_dir: Path, tmp_path: Path, fmt: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The file system turns read-only between the check and the write (a remount, a failing disk)."""
    real_mkdir = os.mkdir

    def read_only(path, *args, **kwargs):
        if Path(path).name.endswith(PARTIAL):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only)
    proc = run_cli("export", str(run_dir), "--format", fmt, "--out", "new/deeper/model", cwd=tmp_path)
    one_paragraph_refusal(proc, "Read-only file system", "nothing was changed", "a folder you can write to")
    assert os.listdir(tmp_path) == [], "the parent folders made for it are removed again"


@pytest.mark.parametrize("when", ["writing", "swapping"])
def test_an_interrupted_export_leaves_the_previous_one_whole(run_dir: Path, tmp_path: Path, when: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    out = export_run(run_dir, tmp_path / "model")
    dead = next(pid for pid in range(4_000_000, 4_100_000) if not Path(f"/proc/{pid}").exists())
    (tmp_path / f".model.{dead}{PARTIAL}").mkdir()  # an export that was killed: nothing cleans it but the next
    before = hashes(out)
    real_replace = os.replace

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C

    def replace(source: str | os.PathLike, target: str | os.PathLike) -> None:
        if str(source).endswith(PARTIAL):  # the previous export is already moved aside
            raise KeyboardInterrupt
        real_replace(source, target)

    if when == "writing":
        monkeypatch.setattr("llmtrain.runs.export.save_model", interrupted)
    else:
        monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        export_run(run_dir, out)
    assert hashes(out) == before
    assert sorted(os.listdir(tmp_path)) == ["model"], "no hidden half folder left, the killed one's removed"


# ---- eval task files ---------------------------------------------------------------------------

def read(entry: str, **settings: object):
    return read_tasks(parse_task_specs([entry]), EvalConfig(**settings))[0]


def write_lines(path: Path, *lines: bytes | dict) -> Path:
    path.write_bytes(b"".join((json.dumps(x).encode() if isinstance(x, dict) else x) + b"\n" for x in lines))
    return path


@pytest.mark.parametrize("kind", ["multiple_choice", "perplexity"])
def test_a_fifo_or_a_device_as_a_task_file_says_what_it_is(fifo: Path, kind: str) -> None:
    with pytest.raises(UserError, match=rf"'{kind}:{fifo}': {fifo} is a FIFO \(named pipe\), not a regular file"):
        read(f"{kind}:{fifo}")
    with pytest.raises(UserError, match=rf"'{kind}:/dev/zero': /dev/zero is a device, not a regular file"):
        read(f"{kind}:/dev/zero")


def test_eval_and_train_refuse_a_fifo_task_file_in_one_paragraph(run_dir: Path, fifo: Path, tmp_path: Path) -> None:
    before = hashes(run_dir)
    proc = run_cli("eval", str(run_dir), f"eval.tasks=[multiple_choice:{fifo}]", cwd=tmp_path)
    one_paragraph_refusal(proc, str(fifo), "is a FIFO (named pipe)")
    proc = run_cli("train", *TINY, "max_steps=2", f"eval.tasks=[perplexity:{fifo}]",
                   f"hydra.run.dir={tmp_path / 'train'}", cwd=tmp_path)
    one_paragraph_refusal(proc, str(fifo), "is a FIFO (named pipe)")
    assert hashes(run_dir) == before and not (tmp_path / "train").exists()


def test_a_fifo_in_a_held_out_folder_is_passed_over(make_fifo: Callable[[Path], Path], tmp_path: Path) -> None:
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "real.txt").write_text("held-out text")
    make_fifo(tmp_path / "held" / "pipe.txt")
    source = read(f"perplexity:{tmp_path / 'held'}")
    assert [Path(d.where).name for d in source.documents] == ["real.txt"]


DEEP = b"[" * 100_000 + b"]" * 100_000
MC_HOSTILE = [
    ([GOOD_LINE, DEEP], r"mc.jsonl:2 is nested too deeply"),
    ([GOOD_LINE, b'{"ctx": "' + b"x" * (2 << 20) + b'"}'], r"mc.jsonl:2 \(a multiple-choice file\) is a line longer "
                                                             r"than 1 MB"),
    ([b'{"ctx": "caf\xe9"}'], r"mc.jsonl:1 is not UTF-8 text \(byte 13 of the line is 0xE9\)"),
    ([{"ctx": "a", "endings": [f"e{i}" for i in range(1001)], "label": 0}], r"mc.jsonl:1 has 1,001 endings; an example "
                                                                           r"has at most 1,000"),
    ([{"ctx": "a", "endings": ["x", {"y": 1}], "label": 0}], r"mc.jsonl:1: the endings must be a list of at least 2 "
                                                             r"strings"),
    ([{"ctx": "a", "endings": ["x", "y"], "label": 2}], r"mc.jsonl:1: the label 2 is out of range"),
    ([{"ctx": "a", "endings": ["x", "y"], "label": 10**400}], r"the label 1000.*is out of range"),
    ([b'{"ctx": "a\x00b", "endings": ["x", "y"], "label": 0}'], r"mc.jsonl:1 is not valid JSON \(Invalid control "
                                                                r"character"),
    ([b'{"ctx": "a\\ud800", "endings": ["x", "y"], "label": 0}'], r"mc.jsonl:1: the context holds an unpaired "
                                                                  r"surrogate \(U\+D800"),
    ([b"", b"   "], r"mc.jsonl has no example"),
]


@pytest.mark.parametrize(("lines", "message"), MC_HOSTILE)
def test_a_hostile_multiple_choice_file_is_refused_naming_the_line(tmp_path: Path, lines: list, message: str) -> None:
    path = write_lines(tmp_path / "mc.jsonl", *lines)
    with pytest.raises(UserError, match=message) as refused:
        read(f"multiple_choice:{path}")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(("line", "message"), [
    (DEEP, r"docs.jsonl:2 is not valid JSON \(maximum recursion depth"),
    (b'{"text": "a\\udc00b"}', r"docs.jsonl:2: the field 'text' holds an unpaired surrogate"),
])
def test_a_hostile_held_out_jsonl_line_is_refused_naming_it(tmp_path: Path, line: bytes, message: str) -> None:
    path = write_lines(tmp_path / "docs.jsonl", {"text": "fine"}, line)
    with pytest.raises(UserError, match=message) as refused:
        read(f"perplexity:{path}")
    assert "\n" not in str(refused.value)


def test_a_binary_file_without_line_breaks_is_refused_after_one_line(tmp_path: Path) -> None:
    path = tmp_path / "mc.jsonl"
    path.write_bytes(os.urandom(1 << 16).replace(b"\n", b"") * 48)  # 3 MB, no line break
    with pytest.raises(UserError, match=r"mc.jsonl:1 \(a multiple-choice file\) is a line longer than 1 MB"):
        read(f"multiple_choice:{path}")


def test_a_byte_order_mark_is_read_past(tmp_path: Path) -> None:
    path = tmp_path / "mc.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD_LINE).encode() + b"\n")
    assert read(f"multiple_choice:{path}").examples[0].endings == GOOD_LINE["endings"]


def test_a_nested_line_is_one_paragraph_on_the_command_line(run_dir: Path, tmp_path: Path) -> None:
    path = write_lines(tmp_path / "mc.jsonl", GOOD_LINE, DEEP)
    proc = run_cli("eval", str(run_dir), f"eval.tasks=[multiple_choice:{path}]", "--out", "results", cwd=tmp_path)
    one_paragraph_refusal(proc, f"{path}:2 is nested too deeply")
    assert not (tmp_path / "results").exists()


def test_task_files_past_the_size_bound_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound (1 GB) made small: what a task holds in memory is counted as it is read."""
    monkeypatch.setattr(multiple_choice, "TASK_BYTES", 200)
    monkeypatch.setattr(perplexity, "TASK_BYTES", 200)
    mc = write_lines(tmp_path / "mc.jsonl", *[GOOD_LINE] * 5)
    with pytest.raises(UserError, match=r"mc.jsonl holds more than .* of examples by line 3"):
        read(f"multiple_choice:{mc}")
    assert len(read(f"multiple_choice:{mc}", limit=2).examples) == 2, "eval.limit stops reading first"
    (tmp_path / "big.txt").write_text("x" * 300)
    with pytest.raises(UserError, match=r"big.txt is .* GB, one document more than"):
        read(f"perplexity:{tmp_path / 'big.txt'}")
    docs = write_lines(tmp_path / "docs.jsonl", *[{"text": "y" * 80}] * 5)
    with pytest.raises(UserError, match=r"'perplexity:.*docs.jsonl' holds more than .* by .*docs.jsonl:3"):
        read(f"perplexity:{docs}")


def test_a_long_context_is_held_at_the_windows_size_and_scores_the_same(tmp_path: Path) -> None:
    import torch

    from llmtrain.config.schema import ModelConfig

    window, context = 32, "lorem ipsum " * 40_000  # 480 KB: 480,000 byte tokens
    path = write_lines(tmp_path / "mc.jsonl", {"ctx": context, "endings": ["dolor", "sit amet"], "label": 0})
    tokenizer = ByteTokenizer()
    task = read(f"multiple_choice:{path}").encode(tokenizer, window, tokenizer.eos_id, True, lambda m: None)
    assert all(len(ctx) <= window + 2 for ctx, _ in task.requests)
    full = [encode_pair(tokenizer, context, " " + e, tokenizer.eos_id) for e in ("dolor", "sit amet")]
    torch.manual_seed(0)
    scorer = Scorer(GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=window), 256), window)
    assert scorer.loglikelihood(task.requests) == scorer.loglikelihood(full)


def test_many_examples_are_scored_a_bounded_chunk_at_a_time(tmp_path: Path) -> None:
    """Each Scorer call prepares its requests' windows at once: a file's worth would not fit."""
    from llmtrain.config.schema import ModelConfig

    path = write_lines(tmp_path / "mc.jsonl", *[{"ctx": f"n{i}", "endings": ["yes", "no"], "label": i % 2}
                                                for i in range(40)])
    tokenizer = ByteTokenizer()
    task = read(f"multiple_choice:{path}").encode(tokenizer, 32, tokenizer.eos_id, True, lambda m: None)
    scorer = Scorer(GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=32), 256), 32, batch_size=1)
    calls: list[int] = []
    real = scorer.loglikelihood
    scorer.loglikelihood = lambda requests, *a, **k: calls.append(len(requests)) or real(requests, *a, **k)
    assert task.run(scorer)["examples"] == 40
    assert calls == [64, 16]


# ---- eval results and the run's config -----------------------------------------------------------

def test_every_unreadable_eval_json_is_kept_under_its_own_name(run_dir: Path, tmp_path: Path) -> None:
    held_out = tmp_path / "held_out.txt"
    held_out.write_text(TINY_CORPUS.read_text()[:300])
    out = tmp_path / "results"
    out.mkdir()
    for number, suffix in enumerate(["", ".1", ".2"]):
        (out / "eval.json").write_text(f"{{broken {number}")
        proc = run_cli("eval", str(run_dir), f"eval.tasks=[perplexity:{held_out}]", "--out", str(out), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert f"It is kept as eval.json.unreadable{suffix}, and a new eval.json is started" in proc.stderr
        assert f"{out / 'eval.json'} (the evaluation results) is not valid JSON" in proc.stderr
    assert [(out / f"eval.json.unreadable{s}").read_text() for s in ["", ".1", ".2"]] == [
        "{broken 0", "{broken 1", "{broken 2"]
    assert f"perplexity:{held_out}" in json.loads((out / "eval.json").read_text())["tasks"]


def test_an_eval_json_that_is_a_fifo_is_moved_aside_unopened(make_fifo: Callable[[Path], Path],
                                                            tmp_path: Path) -> None:
    make_fifo(tmp_path / "eval.json")
    warnings: list[str] = []
    write_results(tmp_path, {"perplexity:x": {"kind": "perplexity", "loss": 1.0}}, {"model": "m"}, warn=warnings.append)
    assert warnings == [f"{tmp_path / 'eval.json'} (the evaluation results) is a FIFO (named pipe), not a regular "
                        "file. It is kept as eval.json.unreadable, and a new eval.json is started."]
    assert (tmp_path / "eval.json.unreadable").is_fifo()
    assert json.loads((tmp_path / "eval.json").read_text())["tasks"]["perplexity:x"]["loss"] == 1.0


def test_a_billion_laughs_config_yaml_is_refused_at_once(tmp_path: Path) -> None:
    laughs = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    laughs += [f"{c}: &{c} [{', '.join(['*' + p] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
    (tmp_path / "config.yaml").write_text("\n".join(laughs) + "\n")
    with pytest.raises(UserError, match=r"config.yaml \(the run's config\) expands to more than"):
        saved_config(tmp_path)
