"""No process outlives what started it: the ranks of parallel.nproc die with a launcher killed by
SIGKILL, and a test run stopped with Ctrl-C (or finished) leaves nothing behind (conftest's rule
for the processes a test starts). Each waits by polling /proc, never by a fixed sleep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from . import conftest
from .conftest import TINY_CORPUS

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads processes from /proc (Linux)")

REPO = Path(__file__).resolve().parents[1]
TAG = "LLMTRAIN_TEST_ORPHAN_TAG"  # every process of a case carries it in its environment
# Two ranks of a tiny model, long enough to be still training when the test stops it.
LONG_RUN = ["train", "data=text", f"data.path={TINY_CORPUS}", "data.tokenizer=char", "model.n_layer=1",
            "model.n_embd=32", "model.n_head=2", "model.block_size=32", "micro_batch_size=2", "global_batch_size=4",
            "max_steps=100000", "schedule.warmup_steps=1", "eval_interval=0", "log_interval=1", "threads=1",
            "checkpoint=none", "parallel=ddp", "parallel.nproc=2"]
# A process with a child of its own that would sleep for ten minutes: what no product code cleans up.
SLEEPER_TREE = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']).wait()"


def tagged(tag: str) -> list[int]:
    """The live processes (zombies count as gone) whose environment holds TAG=tag."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = conftest._proc_stat(int(entry.name))
        except OSError:
            continue
        if state is not None and state[0] != "Z" and needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def wait_until(condition, what: str, timeout: float = 120) -> None:
    """Poll `condition` until it holds; fail naming `what` when `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"after {timeout:.0f} s still not: {what}")
        time.sleep(0.05)


def trained_a_step(run_dir: Path) -> bool:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return False
    return any(line.endswith("}") and json.loads(line).get("kind") == "train" for line in lines)


def gone(tag: str) -> bool:
    return not tagged(tag)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["starting", "training"])
def test_the_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path: Path, when: str) -> None:
    """SIGKILL runs no handler of the launcher, so nothing relays a stop to its ranks: they end by
    themselves, whether they were still starting (importing torch, before any rendezvous) or
    already training."""
    tag = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "llmtrain", *LONG_RUN, f"hydra.run.dir={run_dir}"],
                                cwd=tmp_path, env={**os.environ, TAG: tag}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def ranks() -> list[int]:  # the launcher's children but multiprocessing's resource tracker
        return [pid for pid in tagged(tag) if pid != launcher.pid and conftest._proc_stat(pid)[1] == launcher.pid
                and b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]

    if when == "starting":
        wait_until(lambda: len(ranks()) >= 2 or launcher.poll() is not None, "the two ranks were started")
    else:
        wait_until(lambda: trained_a_step(run_dir) or launcher.poll() is not None, "the ranks took a step")
    assert launcher.poll() is None, f"the run ended (exit {launcher.returncode}) before it could be killed"
    started = ranks()
    assert len(started) == 2, f"expected two ranks beside the launcher, found {started}"
    launcher.kill()
    launcher.wait()
    wait_until(lambda: gone(tag), f"the processes {tagged(tag)} of a SIGKILLed launcher are gone", timeout=60)


INNER_TEST = """\
import subprocess, sys, time
from pathlib import Path

RUN_DIR = Path({run_dir!r})


def test_starts_processes():
    subprocess.Popen([sys.executable, "-c", {sleeper!r}])
    run = [sys.executable, "-m", "llmtrain", *{run!r}, f"hydra.run.dir={{RUN_DIR}}"]
    if {interrupted!r}:
        subprocess.run(run)  # until Ctrl-C
        return
    subprocess.Popen(run)  # returns with the ranks training
    deadline = time.monotonic() + 120
    while not (RUN_DIR / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "passed"])
def test_a_test_run_leaves_no_process_behind(tmp_path: Path, how: str) -> None:
    """A pytest run (with this suite's conftest) whose test started a two-rank run and a process
    tree of its own: Ctrl-C (SIGINT to pytest's process group, as a terminal sends it) while they
    run, or a test that returns with them still running, leaves none of them alive."""
    tag = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    inner = tmp_path / "test_inner.py"
    inner.write_text(INNER_TEST.format(run_dir=str(run_dir), sleeper=SLEEPER_TREE, run=LONG_RUN,
                                       interrupted=how == "ctrl-c"))
    pytest_run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), str(inner)],
        cwd=REPO, env={**os.environ, TAG: tag}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if how == "ctrl-c":
        wait_until(lambda: trained_a_step(run_dir) or pytest_run.poll() is not None, "the inner test's run took a step")
        assert pytest_run.poll() is None, pytest_run.communicate()[0]
        running = tagged(tag)
        assert len(running) >= 6, f"pytest, the sleeper and its child, the launcher and two ranks: {running}"
        os.killpg(pytest_run.pid, signal.SIGINT)  # pytest_run leads its own group (conftest gives it a session)
    output = pytest_run.communicate(timeout=120)[0]
    assert pytest_run.returncode == (2 if how == "ctrl-c" else 0), output  # 2: pytest's "interrupted"
    wait_until(lambda: gone(tag), f"every process of the inner test run is gone (left: {tagged(tag)})", timeout=30)


def test_what_a_killed_child_leaves_behind_is_killed_at_teardown(tmp_path: Path) -> None:
    """conftest's own mechanism, in this process: a child whose grandchild outlives it (re-parented
    to pytest, the subreaper) has that grandchild killed by the teardown's sweep of its session."""
    if conftest._PRCTL is None:
        pytest.skip("needs prctl (Linux)")
    tag = uuid.uuid4().hex
    child = subprocess.Popen([sys.executable, "-c", SLEEPER_TREE], env={**os.environ, TAG: tag})
    wait_until(lambda: len(tagged(tag)) == 2, "the child and its grandchild run", timeout=60)
    child.kill()  # the grandchild is orphaned: it comes to pytest
    child.wait()
    (orphan,) = tagged(tag)
    assert conftest._proc_stat(orphan)[1] == os.getpid(), "pytest (the subreaper) is the orphan's parent now"
    conftest._kill_sessions([child])
    assert tagged(tag) == [] and conftest._proc_stat(orphan) is None, "killed and reaped"
