"""Output that reads right when piped, and degenerate data that does not train silently.

Piped output (a file, `| tee`, CI) gets plain lines: no hard wraps inside a sentence, no trailing
padding, no colour codes; the review and the report agree with what resume says. A corpus of NUL
bytes, of whitespace only or of undecodable bytes warns in the pre-flight check, naming the file;
a UTF-16/32 file with a byte-order mark is decoded as such.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from llmtrain.config.schema import DataConfig, DataSource, TokenizerKind
from llmtrain.core.console import default_console
from llmtrain.core.findings import Status
from llmtrain.data import corpus
from llmtrain.data.prepare import prepare_data
from llmtrain.metrics.dashboard import Dashboard
from llmtrain.preflight.check import run_check
from llmtrain.runs.records import Records
from llmtrain.runs.report import build_report
from llmtrain.runs.report.overfitting import overfitting
from llmtrain.training.banner import threads_text
from llmtrain.training.loop import train

from ..conftest import TINY_CORPUS, tiny_config
from ..test_cli_run import TINY

ANSI = re.compile(r"\x1b\[")


def piped(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The CLI with stdout and stderr pipes and COLUMNS unset, as `llmtrain ... > log` runs it."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE")}
    return subprocess.run([sys.executable, "-m", "llmtrain", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def assert_plain(text: str) -> None:
    padded = [line for line in text.splitlines() if line != line.rstrip()]
    assert not padded, f"lines with trailing whitespace: {padded[:3]}"
    assert not ANSI.search(text), "colour codes in piped output"


# ---------------------------------------------------------------------------------------------
# piped output
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_piped_train_output_is_plain_unwrapped_lines(tmp_path: Path) -> None:
    proc = piped("train", *TINY, "max_steps=4", "report=false", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_plain(proc.stdout)
    assert_plain(proc.stderr)
    baseline = [line for line in proc.stdout.splitlines() if "unigram entropy" in line and "nats/token" in line]
    assert baseline and "the loss to beat" in baseline[0], "the banner's baseline row is one line"
    device = next(line for line in proc.stdout.splitlines() if line.lstrip().startswith("device "))
    assert "1 thread," in device and "threads" not in device
    done = next(line for line in proc.stdout.splitlines() if line.startswith("done: "))
    assert "Weights: " in done, "the closing sentence is not hard-wrapped"


@pytest.mark.slow
def test_piped_check_output_is_plain(tmp_path: Path) -> None:
    proc = piped("check", "--no-compute", *TINY, cwd=tmp_path)
    assert proc.returncode in (0, 1), proc.stderr
    assert_plain(proc.stdout)
    assert proc.stdout.rstrip().endswith(f"-> exit {proc.returncode}")


def test_default_console_off_a_terminal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    console = default_console()
    long = "word " * 60 + "end"
    console.print(long)
    sink = Dashboard(1, console)
    sink.banner("title", [("key", "value " * 40 + "(the loss to beat)"), ("longer key", "v")])
    out = capsys.readouterr().out
    assert_plain(out)
    assert long.rstrip() in out.splitlines(), "a long message stays one line"
    assert any(line.endswith("(the loss to beat)") and "key" in line for line in out.splitlines())
    monkeypatch.setenv("COLUMNS", "50")  # an explicit width is honoured, as on a terminal that wide
    default_console().print(long)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 1 and max(map(len, lines)) <= 50
    assert_plain("\n".join(lines))


def test_threads_wording() -> None:
    assert threads_text(1, 1) == "1 thread"
    assert threads_text(4, 1) == "4 threads"
    assert threads_text(1, 2) == "1 thread per process"
    assert threads_text(2, 4) == "2 threads per process"


# ---------------------------------------------------------------------------------------------
# the review and the report agree with resume
# ---------------------------------------------------------------------------------------------


def test_review_states_a_single_evaluation_once() -> None:
    records = Records([{"kind": "train", "step": s, "loss": 4.0 - 0.1 * s} for s in range(45, 50)]
                      + [{"kind": "eval", "step": 49, "val_loss": 3.1}])
    finding = overfitting(records).finding
    # "gap -0.9000 at step 49; best validation loss 3.1000 at step 49", not the gap twice
    assert finding.count("at step 49") == 2 and finding.count("gap") == 1, finding


@pytest.mark.slow
def test_report_tokens_are_the_tokens_resume_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that ends at a step it did not log (here a crash after the step-5 checkpoint, logged
    every 3): the report's tokens are those of step 5, the figure the resume prints."""
    run = tmp_path / "run"
    overrides = {"max_steps": 8, "log_interval": 3, "checkpoint.every_steps": 5, "report": False}
    monkeypatch.setenv("LLMTRAIN_TEST_CRASH_RANK_AT", "0:6")
    with pytest.raises(RuntimeError, match="test crash"):
        train(tiny_config(run, **overrides), console=Dashboard(8, Console(file=io.StringIO(), width=300)))
    monkeypatch.delenv("LLMTRAIN_TEST_CRASH_RANK_AT")
    report_tokens = dict(build_report(run, inference_check=False).facts)["tokens"]

    output = io.StringIO()
    train(tiny_config(run, **overrides), console=Dashboard(8, Console(file=output, width=300)))
    resumed = re.search(r"resumed from .*?: step (\d+), ([\d,]+) tokens", output.getvalue())
    assert resumed, output.getvalue()
    assert resumed.group(1) == "5"
    assert report_tokens == resumed.group(2)


def test_report_tokens_of_an_older_run_come_from_the_checkpoint(tmp_path: Path) -> None:
    """metrics.jsonl of a run before end records had tokens: the step's checkpoint says them."""
    step_dir = tmp_path / "checkpoints" / "step_00000049"
    step_dir.mkdir(parents=True)
    (step_dir / "trainer_state.json").write_text(json.dumps({"format": 1, "state": {"step": 49, "tokens": 200_704}}))
    records = [{"kind": "train", "step": 40, "tokens": 163_840, "loss": 3.0},
               {"kind": "checkpoint", "step": 49}, {"kind": "end", "step": 49}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert dict(build_report(tmp_path, inference_check=False).facts)["tokens"] == "200,704"


# ---------------------------------------------------------------------------------------------
# degenerate data
# ---------------------------------------------------------------------------------------------

DEGENERATE = {
    "nul.txt": b"\0" * 5000,
    "blank.txt": b"   \n\t \n\n" * 700,
    "binary.txt": np.random.default_rng(0).integers(0x80, 0x100, 6000, dtype=np.uint8).tobytes(),
}


def _text_config(path: Path, out: Path, **overrides: object):
    return tiny_config(out, **{"data.path": str(path), **overrides})


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DEGENERATE))
def test_check_warns_on_degenerate_data_naming_the_file(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(DEGENERATE[name])
    # Not prepared yet: the check samples the file itself (`llmtrain check` in a subprocess).
    proc = piped("check", "--no-compute", "data=text", f"data.path={path}", "data.tokenizer=char", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    row = [line for line in proc.stdout.splitlines() if "data content" in line]
    assert row and "WARN" in row[0] and name in proc.stdout
    # Prepared: from the facts prepare recorded (what `llmtrain train` checks).
    cfg = _text_config(path, tmp_path / "run")
    data = prepare_data(cfg.data, log=lambda _: None)
    content = run_check(cfg, measure_compute=False, data_meta=data.meta).row("data content")
    assert content.status is Status.WARN and name in content.seen


def test_ordinary_text_passes_the_data_content_item(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path / "run")
    assert run_check(cfg, measure_compute=False).row("data content").status is Status.PASS  # sampled
    data = prepare_data(cfg.data, log=lambda _: None)
    assert run_check(cfg, measure_compute=False, data_meta=data.meta).row("data content").status is Status.PASS


def test_one_degenerate_file_among_text_is_named(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "good.txt").write_bytes(TINY_CORPUS.read_bytes())
    (tmp_path / "corpus" / "nul.txt").write_bytes(DEGENERATE["nul.txt"])
    cfg = _text_config(tmp_path / "corpus", tmp_path / "run")
    data = prepare_data(cfg.data, log=lambda _: None)
    row = run_check(cfg, measure_compute=False, data_meta=data.meta).row("data content")
    assert row.status is Status.WARN and "nul.txt" in row.seen and "good.txt" not in row.seen


def test_train_on_degenerate_data_runs_and_its_banner_lists_the_warning(tmp_path: Path) -> None:
    path = tmp_path / "nul.txt"
    path.write_bytes(DEGENERATE["nul.txt"])
    output = io.StringIO()
    result = train(_text_config(path, tmp_path / "run", max_steps=3, report=False),
                   console=Dashboard(2, Console(file=output, width=400)))
    assert result.steps == 3
    assert re.search(r"warn\s+data content: nul\.txt", output.getvalue()), output.getvalue()


# ---------------------------------------------------------------------------------------------
# UTF-16 / UTF-32 with a byte-order mark
# ---------------------------------------------------------------------------------------------

UNICODE_TEXT = TINY_CORPUS.read_text(encoding="utf-8")[:6000] + "\nnaïve café 日本語 😀 — end\n" * 20
ENCODINGS = {  # name -> the file's bytes (mark + encoded text)
    "UTF-16 LE": b"\xff\xfe" + UNICODE_TEXT.encode("utf-16-le"),
    "UTF-16 BE": b"\xfe\xff" + UNICODE_TEXT.encode("utf-16-be"),
    "UTF-32 LE": b"\xff\xfe\0\0" + UNICODE_TEXT.encode("utf-32-le"),
    "UTF-32 BE": b"\0\0\xfe\xff" + UNICODE_TEXT.encode("utf-32-be"),
}


def _tokens(tmp_path: Path, name: str, data: bytes, tokenizer: TokenizerKind, **extra: object) -> tuple:
    """(train ids, val ids, the log lines, the prepared data, its config) of one file holding `data`."""
    folder = tmp_path / name.replace(" ", "_")
    folder.mkdir(exist_ok=True)
    (folder / "corpus.txt").write_bytes(data)
    cfg = DataConfig(source=DataSource.text, path=str(folder / "corpus.txt"), tokenizer=tokenizer,
                     val_fraction=0.1, cache_dir=str(tmp_path / "cache"), **extra)
    said: list[str] = []
    prepared = prepare_data(cfg, log=said.append)
    return np.asarray(prepared.tokens("train")), np.asarray(prepared.tokens("val")), said, prepared, cfg


@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
@pytest.mark.parametrize("tokenizer", [TokenizerKind.char, TokenizerKind.byte])
def test_marked_utf16_and_utf32_files_train_as_their_text(tmp_path: Path, encoding: str,
                                                          tokenizer: TokenizerKind) -> None:
    train_ids, val_ids, *_ = _tokens(tmp_path, "utf-8", UNICODE_TEXT.encode("utf-8"), tokenizer)
    got_train, got_val, said, prepared, cfg = _tokens(tmp_path, encoding, ENCODINGS[encoding], tokenizer)
    assert np.array_equal(got_train, train_ids) and np.array_equal(got_val, val_ids)
    assert said.count(f"corpus.txt: {encoding} (byte-order mark), decoded as such") == 1
    assert not any("not valid UTF-8" in line for line in said)
    assert prepared.meta["decoded_from"] == {"corpus.txt": encoding}
    again: list[str] = []
    assert prepare_data(cfg, log=again.append).directory == prepared.directory and not again, "said once"


def test_decoding_streams_across_pieces_and_respects_max_bytes(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 1,001 bytes split UTF-16 code units and surrogate pairs; the byte cap counts the
    decoded UTF-8 bytes, so it cuts where it cuts the UTF-8 file."""
    monkeypatch.setattr(corpus, "PIECE_BYTES", 1001)
    for extra in ({}, {"max_bytes": 7777}):
        want = _tokens(tmp_path, f"utf-8-{len(extra)}", UNICODE_TEXT.encode("utf-8"), TokenizerKind.char, **extra)
        got = _tokens(tmp_path, f"utf-16-{len(extra)}", ENCODINGS["UTF-16 LE"], TokenizerKind.char, **extra)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), extra


def test_an_old_cache_of_a_marked_file_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache prepared when the file was read as UTF-8 (U+FFFD garbage) is not reused."""
    with monkeypatch.context() as patch:  # the old reading: no byte-order mark recognised
        patch.setattr(corpus, "marked_encoding", lambda path: None)
        patch.setattr("llmtrain.data.cache.marked_encoding", lambda path: None)
        old = _tokens(tmp_path, "UTF-16 LE", ENCODINGS["UTF-16 LE"], TokenizerKind.char)
    assert any("not valid UTF-8" in line for line in old[2])
    want = _tokens(tmp_path, "utf-8", UNICODE_TEXT.encode("utf-8"), TokenizerKind.char)
    new = _tokens(tmp_path, "UTF-16 LE", ENCODINGS["UTF-16 LE"], TokenizerKind.char)
    assert new[3].directory != old[3].directory
    assert np.array_equal(new[0], want[0]) and np.array_equal(new[1], want[1])
