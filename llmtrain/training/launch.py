"""How the ranks of a run start, in one place.

Three ways, one contract: every rank finds RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in its environment (what torchrun sets) and runs the whole train loop
(`llmtrain.distributed.layout.layout_from_env` reads them).

- torchrun: it starts the processes; each runs `llmtrain train`, and `shared_run_dir` makes them
  agree on one run dir over torchrun's own key-value store.
- hydra/launcher=slurm (or submitit_local) with several tasks: `ranks_from_submitit_tasks` turns
  each task into a rank.
- parallel.nproc=N: `run_local_ranks` spawns N workers on this machine (`spawn_local`), each
  running `rank_main`, and turns a failed rank into the exit code and line the CLI reports
  (`RanksStopped`).

Only the standard library at module level: the CLI imports this before it knows whether torch is
needed.
"""

from __future__ import annotations

import functools
import os
import pickle
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from llmtrain.core.errors import (
    EXIT_ABORTED,
    EXIT_HEALTH_STOP,
    EXIT_INTERRUPTED,
    EXIT_NONFINITE_STOP,
    EXIT_SAVE_FAILED,
    EXIT_USER_ERROR,
    UserError,
)

if TYPE_CHECKING:
    from torch.multiprocessing import ProcessExitedException

    from llmtrain.config.schema import Config


# ---------------------------------------------------------------------------------------------
# torchrun and submitit: the processes exist already
# ---------------------------------------------------------------------------------------------


def shared_run_dir() -> str:
    """The run dir every rank of a torchrun job uses. Under torchrun every rank runs Hydra, and each
    would take its own timestamped run dir: rank 0 picks Hydra's default name and hands it to the
    others through torchrun's own key-value store. Raises UserError when they cannot agree."""
    import datetime

    from torch.distributed import TCPStore

    # Per torchrun run id, kept across torchrun's restarts: a restarted job finds its checkpoints.
    key = f"llmtrain/run_dir/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    try:
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=120))
        if os.environ.get("RANK") == "0":  # the first value written stays
            store.compare_set(key, "", datetime.datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S"))
        return store.get(key).decode()
    except (KeyError, ValueError, RuntimeError) as err:
        raise UserError(
            f"{os.environ.get('WORLD_SIZE')} processes were started (WORLD_SIZE) but they could not agree on a run dir "
            f"({type(err).__name__}: {err}); give one to all of them: hydra.run.dir=PATH.") from None


def ranks_from_submitit_tasks() -> None:
    """A job of hydra/launcher=slurm (or submitit_local) with several tasks: each task is one rank,
    as torchrun would set them (RANK, WORLD_SIZE, ...). The rendezvous is the job's first node, on a
    port derived from the job id, so every task of the job finds it and other jobs do not. Nothing
    outside submitit, or for a job of one task."""
    if os.environ.get("WORLD_SIZE") or not os.environ.get("SUBMITIT_EXECUTOR"):
        return
    import zlib

    import submitit

    job = submitit.JobEnvironment()
    if job.num_tasks <= 1:
        return
    os.environ.update(
        RANK=str(job.global_rank), WORLD_SIZE=str(job.num_tasks), LOCAL_RANK=str(job.local_rank),
        LOCAL_WORLD_SIZE=str(job.num_tasks // max(job.num_nodes, 1)),
        MASTER_ADDR=job.hostnames[0] if job.num_nodes > 1 else "127.0.0.1",
        MASTER_PORT=str(20000 + zlib.crc32(str(job.job_id).encode()) % 20000),
    )


# ---------------------------------------------------------------------------------------------
# parallel.nproc: this process starts the ranks
# ---------------------------------------------------------------------------------------------


class RanksStopped(Exception):
    """The ranks of parallel.nproc ended the run with a failing exit code. The CLI exits with
    `exit_code`, after printing `llmtrain: <label>: <message>` when there is a message (None when
    rank 0 has printed the reason itself)."""

    def __init__(self, exit_code: int, message: str | None = None, label: str = "error") -> None:
        super().__init__(message or f"the ranks exited with code {exit_code}")
        self.exit_code = exit_code
        self.message = message
        self.label = label


def run_local_ranks(cfg: Config, resume_hint: Callable[[object], str],
                    describe: Callable[[Path], None] | None = None) -> None:
    """parallel.nproc=N: run N ranks on this machine under this one Hydra run dir; returns when all
    succeed. When a rank fails, the others are stopped at once and RanksStopped carries the failing
    rank's exit code. The ranks run without Hydra: rank 0 gets the run's description to write
    (`describe`, picklable) with its cfg; `resume_hint(run_dir)` is the line that says how to resume."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    try:
        spawn_local(cfg.parallel.nproc, functools.partial(rank_main, on_accept=describe), cfg)
    except ProcessExitedException as err:
        raise _stopped_by_exit(err, cfg, resume_hint) from None
    except ProcessRaisedException as err:
        raise RanksStopped(1, f"rank {err.error_index} of {cfg.parallel.nproc} failed and the other ranks were "
                           f"stopped:\n{err.msg.strip()}") from None


def _stopped_by_exit(err: ProcessExitedException, cfg: Config, resume_hint: Callable[[object], str]) -> RanksStopped:
    """What a rank's exit code (or signal) means for the whole run."""
    if err.exit_code == EXIT_ABORTED:  # a second signal: rank 0 said so in its one line
        return RanksStopped(EXIT_ABORTED)
    if err.signal_name in ("SIGTERM", "SIGINT"):  # it came before the rank had its handlers
        return RanksStopped(EXIT_INTERRUPTED, f"{err.signal_name} while the ranks were starting, before the first "
                            "step: nothing to save yet; the same command starts the run again", label="stopped")
    code = err.exit_code if err.exit_code and err.exit_code > 0 else 1
    if code in (EXIT_INTERRUPTED, EXIT_NONFINITE_STOP, EXIT_HEALTH_STOP, EXIT_SAVE_FAILED):
        return RanksStopped(code, resume_hint(cfg.out_dir), label="stopped")
    if code != EXIT_USER_ERROR or err.error_index != 0:  # rank 0 prints its own user errors
        return RanksStopped(code, f"rank {err.error_index} of {cfg.parallel.nproc} exited with code {err.exit_code}; "
                            "the other ranks were stopped")
    return RanksStopped(code)


def rank_main(cfg: Config, on_accept: Callable[[Path], None] | None = None) -> NoReturn:
    """One rank started by parallel.nproc: trains; rank 0 prints errors; every rank exits with the code.

    The exit skips interpreter teardown (os._exit after flushing): torch's C++ threads (FSDP2 over
    gloo) can abort it ("terminate called without an active exception") after a run that went
    well. An unexpected exception still propagates, so the parent shows its traceback."""
    from llmtrain.core.errors import RunStopped
    from llmtrain.training.loop import train

    is_main = os.environ.get("RANK") == "0"
    code = 0
    try:
        train(cfg, on_accept=on_accept)
    except UserError as err:
        code = EXIT_USER_ERROR
        if is_main:
            sys.stderr.write(f"llmtrain: error: {err}\n")
        else:  # a refusal every rank raises together: rank 0 exits first, so the parent shows its paragraph alone
            import time

            time.sleep(2)
    except RunStopped as stopped:
        code = stopped.exit_code
        if is_main:
            sys.stderr.write(f"llmtrain: stopped: {stopped}\n")
    except KeyboardInterrupt as err:  # a second signal: torch's worker wrapper would turn it into exit 0
        from llmtrain.training.interrupts import abort_message, announce_abort

        code = EXIT_ABORTED
        if is_main:
            announce_abort(abort_message(err))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    """A TCP port free on this machine now, for the ranks' rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_local(nproc: int, target: Any, payload: Any) -> None:
    """Start `nproc` worker processes on this machine, as torchrun would (RANK, WORLD_SIZE, ... set),
    each calling `target(payload)`. Returns when all succeed. When one fails, the others are
    stopped and torch's ProcessExitedException / ProcessRaisedException names the rank. When this
    process dies, even by SIGKILL, the workers stop with it (`die_with_launcher`)."""
    import torch.multiprocessing as mp

    from llmtrain.training.interrupts import StopRequest

    port = free_port()
    context = mp.start_processes(_worker, args=(nproc, port, target, pickle.dumps(payload), os.getpid()),
                                 nprocs=nproc, start_method="spawn", join=False)
    # SIGTERM or Ctrl-C to this parent is passed on to the ranks, which decide (finish the step and
    # save, or abort on a second one; a rank that got it directly too counts it once); this parent
    # waits for them rather than dying first (their exit codes say what happened).
    with StopRequest.shared().relaying(context.pids()):
        while not context.join():
            pass


def _worker(rank: int, nproc: int, port: int, target: Any, payload: bytes, launcher_pid: int) -> None:
    die_with_launcher(launcher_pid)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    target(pickle.loads(payload))


def die_with_launcher(launcher_pid: int) -> None:
    """Make this rank end when the process that started it does, however that one ends (SIGKILL
    and the OOM killer run no handler that could stop the ranks). Linux sends the kernel's
    parent-death signal (prctl PR_SET_PDEATHSIG) to this process then: SIGINT, as torch's spawn
    wrapper also asks for, so the rank stops as on Ctrl-C (one in the train loop finishes its step
    and saves a checkpoint, one still setting up stops at once). The signal only comes for a death
    after the call, and a rank takes seconds to get here (importing torch): a launcher already
    gone means this rank exits now, before its rendezvous could pair it with the other orphans
    for a whole run. Elsewhere than Linux nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no prctl in this libc: nothing to ask for
        return
    pr_set_pdeathsig = 1
    prctl(pr_set_pdeathsig, signal.SIGINT, 0, 0, 0)
    if os.getppid() != launcher_pid:  # re-parented already: the launcher is gone
        os._exit(EXIT_INTERRUPTED)
