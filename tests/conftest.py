"""Shared fixtures: a tiny fp32 config on a small shipped corpus, trained in a few seconds; the
CLI run in this process (`run_cli`); and the rule that every process a test starts ends with it."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from llmtrain.config.schema import (
    Config,
    DataConfig,
    DataSource,
    HeadInit,
    MlpKind,
    ModelConfig,
    NormKind,
    OptimConfig,
    PositionEncoding,
    ScheduleConfig,
    TokenizerKind,
)

ASSETS = Path(__file__).parent / "assets"
TINY_CORPUS = ASSETS / "tiny_corpus.txt"

if "PYTEST_XDIST_WORKER" in os.environ:
    # pytest-xdist's workers (`pytest -n 2`) get COLUMNS=80 and LINES=24: llmtrain would then wrap its
    # piped output at 80 columns, as on a terminal that wide. The tests read it as a pipe shows it,
    # unwrapped (core/console.py default_console), as they do without -n.
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)


def gpt_like(name: str, n_layer: int) -> ModelConfig:
    """gpt_tiny's recipe, smaller: LayerNorm with bias, learned positions, GELU, a tied head (the
    parallel layouts' tests split it)."""
    return ModelConfig(name=name, n_layer=n_layer, n_head=4, n_embd=32, block_size=16, dropout=0.0, bias=True,
                       tie_weights=True, position=PositionEncoding.learned, norm=NormKind.layernorm, mlp=MlpKind.gelu)


def llama_like(name: str, n_layer: int, **overrides: Any) -> ModelConfig:
    """llama_tiny's recipe, smaller: RMSNorm, RoPE, SwiGLU, 2 key/value heads for 4 query heads, no
    biases, an untied head."""
    return ModelConfig(name=name, n_layer=n_layer, n_head=4, n_kv_head=2, n_embd=32, block_size=16, dropout=0.0,
                       bias=False, tie_weights=False, position=PositionEncoding.rope, norm=NormKind.rmsnorm,
                       norm_eps=1e-5, mlp=MlpKind.swiglu, intermediate_size=48, head_init=HeadInit.tiny, **overrides)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prepared data goes to a per-session temp cache, never into the user's ~/.cache."""
    monkeypatch.setenv("LLMTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


_PEAK_SCRIPT = """
import json, sys
import torch
from llmtrain.config.hydra import config_from_dict
from llmtrain.training.loop import train

cfg = config_from_dict(json.loads(sys.argv[1]))
torch.set_num_threads(2)
{predict}
train(cfg)
# VmHWM, not ru_maxrss: the latter keeps the peak of the pre-exec fork, i.e. of the pytest process
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({{"predicted": predicted, "measured": int(status["VmHWM"].split()[0]) * 1024}}))
"""


def predicted_and_measured_peak(out_dir: Path, overrides: dict[str, object], predict: str) -> tuple[float, float]:
    """A two-step tiny run of `overrides` in a fresh interpreter (its peak is its own): `predict`
    (Python lines that set `predicted` from `cfg`, run before training) and the measured peak RSS,
    in bytes. Two steps reach the peak: the second runs forward and backward with the optimizer's
    state, which the first creates. The data is prepared beforehand, as the estimates assume."""
    import json

    from llmtrain.config.schema import config_to_dict
    from llmtrain.data import prepare_data

    cfg = tiny_config(out_dir, **{"max_steps": 2, "schedule.warmup_steps": 1, **overrides})
    prepare_data(cfg.data, log=lambda message: None)
    proc = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT.format(predict=predict),
                           json.dumps(config_to_dict(cfg))], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["predicted"], result["measured"]


def assert_optimizer_states_close(actual: dict, expected: dict, atol: float) -> None:
    """Two optimizer state_dicts in the plain format: the same groups and settings, the same state
    keys per parameter index, every state tensor within `atol` (a split run's views against one process)."""
    import torch

    assert actual["param_groups"] == expected["param_groups"]
    assert sorted(actual["state"]) == sorted(expected["state"])
    for index, state in expected["state"].items():
        assert sorted(actual["state"][index]) == sorted(state)
        for key, value in state.items():
            torch.testing.assert_close(actual["state"][index][key], value, atol=atol, rtol=0,
                                       msg=lambda m, where=(index, key): f"{where}: {m}")



class RecordingMetrics:
    """A metrics writer that keeps the records it is given (the loop parts' tests read them back)."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)


def tiny_config(out_dir: Path, **overrides: object) -> Config:
    """2 layers x 32 wide, context 32, char tokens of the shipped corpus; fp32 on CPU."""
    cfg = Config(
        model=ModelConfig(name="test_tiny", n_layer=2, n_head=2, n_embd=32, block_size=32),
        optim=OptimConfig(lr=3e-3),
        schedule=ScheduleConfig(warmup_steps=2),
        data=DataConfig(
            source=DataSource.text,
            path=str(TINY_CORPUS),
            tokenizer=TokenizerKind.char,
            val_fraction=0.1,
            cache_dir=os.environ.get("LLMTRAIN_CACHE"),
        ),
        seed=1234,
        max_steps=10,
        micro_batch_size=4,
        global_batch_size=8,
        eval_interval=0,
        log_interval=1,
        out_dir=str(out_dir),
        device="cpu",
        threads=1,
    )
    for key, value in overrides.items():
        target = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            target = getattr(target, part)
        setattr(target, leaf, value)
    return cfg


# ---------------------------------------------------------------------------------------------
# `llmtrain ARGV` in this process: what most CLI tests need, without a new interpreter per call
# ---------------------------------------------------------------------------------------------


def starts_processes(argv: Sequence[str]) -> bool:
    """Whether `llmtrain ARGV` starts processes of its own: ranks (parallel.nproc=N), which write to
    the process's own stdout and stderr, or submitit's jobs."""
    return any((a.startswith("parallel.nproc=") and a != "parallel.nproc=1") or a.startswith("hydra/launcher=submitit")
               for a in argv)


def run_cli(*argv: str, cwd: Path, env: dict[str, str | None] | None = None, columns: int = 160,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`llmtrain ARGV` run here, in the test process, as the console script would run it: in `cwd`,
    with `env` applied (None removes a variable), stdout and stderr captured, the exit code from
    SystemExit, and an unexpected exception turned into a traceback on stderr and exit 1 (so a test
    asserting "no traceback" sees it). A subprocess pays ~2 s per call for a new interpreter
    importing torch and Hydra; this pays only the command itself. A command that starts processes
    of its own (`starts_processes`) runs as `python -m llmtrain` in a subprocess all the same, with
    `timeout` as its guard against a hang. Keep a subprocess for the other things only a process
    shows: signals, exit codes of killed processes, import side effects."""
    if starts_processes(argv):
        changes = {"COLUMNS": str(columns), **(env or {})}
        process_env = {k: v for k, v in {**os.environ, **changes}.items() if v is not None}
        return subprocess.run([sys.executable, "-m", "llmtrain", *argv], cwd=cwd, env=process_env,
                              capture_output=True, text=True, timeout=timeout)
    import io
    import logging
    import traceback

    import torch
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from llmtrain.cli import main
    from llmtrain.core import rundir
    from llmtrain.data import cache

    changes = {"COLUMNS": str(columns), **(env or {})}
    saved_env = {key: os.environ.get(key) for key in changes}
    saved_cwd = os.getcwd()
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    saved_threads = torch.get_num_threads()
    # What a new interpreter would not have: the dirs an earlier command created (which a refusal
    # of this one must not remove) and data loaded by an earlier command.
    saved_created = dict(rundir._created)
    rundir._created.clear()
    cache._load_hf.cache_clear()
    cache._pretrained.cache_clear()
    out, err = io.StringIO(), io.StringIO()
    code: int = 0
    try:
        for key, value in changes.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(argv))
            except SystemExit as exited:
                if exited.code is None or isinstance(exited.code, int):
                    code = exited.code or 0
                else:  # sys.exit("message"): Python prints it and exits 1
                    print(exited.code, file=sys.stderr)
                    code = 1
            except Exception:  # noqa: BLE001 - what the interpreter would print before exit 1
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(saved_cwd)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        # Hydra's console handler writes to the captured stream, and a run's train.log handler
        # holds its file open: both end with the command, as they would with its process.
        for handler in [h for h in root.handlers if h not in saved_handlers]:
            root.removeHandler(handler)
            handler.close()
        for handler in saved_handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(saved_level)
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None  # a later train(cfg) in this process has no Hydra job
        torch.set_num_threads(saved_threads)
        rundir._created.clear()
        rundir._created.update(saved_created)
    return subprocess.CompletedProcess(["llmtrain", *argv], code, out.getvalue(), err.getvalue())


# ---------------------------------------------------------------------------------------------
# Processes a test starts end with the test: at its teardown, on Ctrl-C, and when pytest is killed
# ---------------------------------------------------------------------------------------------
#
# An interrupted run used to leave workers behind: subprocess.run kills the `llmtrain` it started
# on KeyboardInterrupt, but not the ranks, data workers or sweep jobs that one started. So every
# process a test starts (subprocess.Popen / subprocess.run called from code that is not a library's)
# gets its own session, and the kernel's parent-death signal (Linux): when pytest dies, even by
# SIGKILL, its children are killed; the product's ranks do the same for their launcher
# (llmtrain.training.launch). pytest is also a "child subreaper": what a killed child leaves
# behind is re-parented to pytest rather than to init, so the teardown below finds it (by the
# session it inherited) and kills it. Processes that libraries start for themselves (wandb's
# service) are left alone: they are the library's to manage across tests. The parent-death signal
# comes when the *thread* that started the child ends: start a process that must outlive its
# thread from the main thread (a pool thread that waits for its child, as benchmarks do, is fine).

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# (imported a second time under another name, this module must not take its own class for the real one)
_real_popen = getattr(subprocess.Popen, "real_popen", subprocess.Popen)
_started: list[subprocess.Popen] = []  # every tracked child of this session, in order


def _prctl() -> Callable[..., int] | None:
    """libc's prctl (Linux), resolved here in the parent: a child between fork and exec should not
    load libraries."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def _dies_with_pytest(previous: Callable[[], object] | None) -> Callable[[], None]:
    pytest_pid = os.getpid()

    def in_child() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != pytest_pid:  # pytest died before the prctl: exec nothing
                os._exit(1)
        if previous is not None:
            previous()

    return in_child


_LIBRARY_DIRS = tuple({sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")})


def _started_by_a_test() -> bool:
    """Whether the code calling subprocess is the tests', the benchmarks' or llmtrain's own, not a
    library's (wandb and friends keep their helper processes across tests on purpose)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == subprocess.__file__:
        frame = frame.f_back
    if frame is None:
        return False
    path = os.path.abspath(frame.f_code.co_filename)
    return not path.startswith(_LIBRARY_DIRS) and "site-packages" not in path


class _TestChild(_real_popen):  # type: ignore[misc, valid-type]
    """subprocess.Popen for the tests' own children: a session of its own, killed with pytest."""

    real_popen = _real_popen

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        tracked = os.name == "posix" and _started_by_a_test()
        if tracked:
            if not kwargs.get("start_new_session") and kwargs.get("process_group") is None:
                kwargs["start_new_session"] = True
            kwargs["preexec_fn"] = _dies_with_pytest(kwargs.get("preexec_fn"))
        super().__init__(*args, **kwargs)
        if tracked:
            _started.append(self)


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, session id) of a process, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[3])


def _kill_sessions(children: list[subprocess.Popen]) -> None:
    """SIGKILL every process of these children's sessions and reap what became ours. A child still
    running is killed with its process group (its pid cannot have been reused: it is not reaped);
    what its session left behind was re-parented to pytest (the subreaper), and is found among
    pytest's own children by the session id it inherited."""
    for child in children:
        if child.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(child.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=10)
    if not children or not Path("/proc/self/stat").exists():  # no /proc: the process groups only
        return
    sessions = {child.pid for child in children}
    me, live_children = os.getpid(), {c.pid for c in _started if c.returncode is None}
    for _ in range(200):  # a killed process's own children come to pytest one level at a time
        left = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in live_children:
                continue
            stat = _proc_stat(int(entry.name))
            if stat is not None and stat[1] == me and stat[2] in sessions:
                left.append(int(entry.name))
        if not left:
            return
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        time.sleep(0.01)


def _kill_all_children() -> None:
    _kill_sessions(list(_started))


def pytest_configure(config: pytest.Config) -> None:
    subprocess.Popen = _TestChild  # type: ignore[misc]
    if _PRCTL is not None:
        _PRCTL(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    atexit.register(_kill_all_children)


def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo[BaseException]) -> None:
    _kill_all_children()


def pytest_unconfigure(config: pytest.Config) -> None:
    _kill_all_children()
    subprocess.Popen = _real_popen  # type: ignore[misc]


@pytest.fixture(autouse=True)
def _children_end_with_their_test() -> Iterator[None]:
    """What a test started ends when the test does, passed or failed."""
    first = len(_started)
    yield
    _kill_sessions(_started[first:])
