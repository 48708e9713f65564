"""`llmtrain <command>`: the dispatcher, and the boundary where Hydra/OmegaConf end.

Nothing heavy is imported at module level: `llmtrain --help` and shell completion must answer
instantly, so torch, hydra and rich are imported inside the command that needs them.

`train` hands its arguments to Hydra unchanged (overrides, `-m`, `--cfg`, `--info`,
`hydra.run.dir=...`, `-sc`), but first composes each requested configuration itself and validates
it, so a bad value fails with exit code 2 and one readable paragraph before any work starts,
instead of Hydra's exit 1 and stack-trace hint.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from llmtrain.errors import EXIT_ABORTED, EXIT_INTERRUPTED, EXIT_USER_ERROR, RunStopped

if TYPE_CHECKING:
    from llmtrain.config import Config

COMMANDS: dict[str, str] = {
    "train": "Train a model from the composed config groups (Hydra overrides, -m sweeps).",
    "prepare": "Tokenize a corpus (text files, folders, globs, JSONL) into cached memory-mapped token files.",
    "check": "Pre-flight checklist + memory/compute estimate for a config; exit 0 pass, 1 warn, 2 fail.",
    "sample": "Generate text from a run directory's trained model (or an export).",
    "export": "Write a run's weights as safetensors + the model config as JSON.",
    "compare": "The runs of a sweep side by side: a table sorted by val loss, a CSV and a PNG of the loss curves.",
    "report": "Post-run review of a run dir: report.md + report.html with plots, a verdict per question.",
    "doctor": "Diagnostic experiments that find bugs fast: overfit, lr-range, grad-check, eval-consistency.",
}

USAGE = """usage: llmtrain <command> [args]

Trains GPT-style language models from composable Hydra config groups.

commands:
{commands}

Run `llmtrain <command> --help` for a command's options, e.g. `llmtrain train --help`.
Quick start: `llmtrain train` trains a small model on Python's own stdlib sources (CPU, no download).
"""


def conf_dir() -> Path:
    """The shipped config groups: inside the installed package, or `conf/` of a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise RuntimeError(f"llmtrain's config folder is missing (looked in {here / 'conf'} and {here.parent / 'conf'})")


def fail(message: str, code: int = EXIT_USER_ERROR, label: str = "error") -> NoReturn:
    sys.stderr.write(f"llmtrain: {label}: {message}\n")
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-sc"], ["--shell-completion"]):
        _complete(args)
        return
    if not args or args[0] in ("-h", "--help", "help"):
        width = max(len(c) for c in COMMANDS)
        print(USAGE.format(commands="\n".join(f"  {c:<{width}}  {h}" for c, h in COMMANDS.items())), end="")
        return
    if args[0] == "--version":
        from llmtrain import __version__

        print(f"llmtrain {__version__}")
        return
    command, rest = args[0], args[1:]
    handlers: dict[str, Callable[[list[str]], None]] = {
        "train": train_command, "prepare": prepare_command, "check": check_command, "sample": sample_command, "export": export_command,
        "compare": compare_command, "report": report_command, "doctor": doctor_command,
    }
    if command not in handlers:
        fail(f"unknown command '{command}'; valid commands: {', '.join(COMMANDS)}. See `llmtrain --help`.")
    try:
        if command == "train":  # SIGTERM/Ctrl-C stop cleanly from here on, also while setting up
            from llmtrain.interrupts import StopRequest

            with StopRequest.shared().setting_up():
                handlers[command](rest)
        else:
            handlers[command](rest)
    except KeyboardInterrupt as err:  # a second signal, or a Ctrl-C outside the train loop
        from llmtrain.interrupts import AbortRequested, abort_at_once, abort_message, announce_abort

        if isinstance(err, AbortRequested):  # at once: the interpreter's teardown can take seconds
            abort_at_once(abort_message(err))
        announce_abort(abort_message(err))
        sys.exit(EXIT_ABORTED)
    except RunStopped as stopped:  # a SIGTERM while setting up, outside the run itself (composing the config)
        fail(str(stopped), stopped.exit_code, label="stopped")


# ---------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------


def train_command(args: list[str]) -> None:
    from hydra._internal.utils import get_args_parser

    parsed = get_args_parser().parse_args(args)
    if parsed.help:
        print(train_help())
        return
    if parsed.multirun and (parsed.cfg or parsed.info):
        fail("-m/--multirun cannot be combined with --cfg or --info; drop -m to print one job's config.")
    if parsed.config_path:
        fail(
            f"--config-path ({parsed.config_path}) is not supported: llmtrain ships its own primary config. "
            "Add your own group options with --config-dir DIR (-cd DIR), e.g. DIR/model/mine.yaml then model=mine."
        )
    if parsed.config_dir and not Path(parsed.config_dir).expanduser().is_dir():
        fail(f"--config-dir is '{parsed.config_dir}', which is not a folder; give a folder of group options like conf/.")
    launched = int(os.environ.get("WORLD_SIZE") or 1)
    if launched > 1 and parsed.multirun:
        fail(f"-m/--multirun under torchrun ({launched} processes): each rank would run the whole sweep. Sweep "
             "from one process with parallel.nproc=N per job, or launch one torchrun per setting.")
    if launched > 1 and not parsed.shell_completion and _given(parsed.overrides, "hydra.run.dir") is None:
        args = [*args, f"hydra.run.dir={_shared_run_dir()}"]  # torchrun: one run dir for all ranks
    runs = not parsed.shell_completion and not parsed.hydra_help and not (parsed.cfg or parsed.info)
    sweep_dir = None
    if runs:
        from llmtrain.errors import UserError

        try:  # before any work: a run dir that cannot be written is a mistake like a bad value
            if parsed.multirun:
                sweep_dir, args = _plan_sweep_dir(parsed.overrides, args)
            else:
                args = _plan_run_dir(args, parsed.config_dir, parsed.config_name)
        except UserError as err:
            fail(str(err))
    if not parsed.shell_completion and not parsed.hydra_help:
        from llmtrain.errors import UserError

        flush_denormals_first(parsed.overrides)
        try:
            validate_overrides(
                parsed.overrides, multirun=parsed.multirun, extra_dir=parsed.config_dir, config_name=parsed.config_name,
                preflight=not (parsed.cfg or parsed.info),
            )
        except UserError as err:
            fail(str(err))
    try:
        _run_hydra(args, _train_task)
    except SystemExit as stop:
        if sweep_dir is not None and stop.code == EXIT_USER_ERROR:  # a refused job: a new sweep dir goes if it holds no run
            from llmtrain.rundir import discard_created

            discard_created(sweep_dir, only_if_empty=True, keep=frozenset({"multirun.yaml"}))
        raise
    if sweep_dir is not None and os.environ.get("RANK", "0") == "0" and Path(sweep_dir).is_dir():
        compare_command([sweep_dir])  # a sweep ends with its comparison table


def _plan_sweep_dir(overrides: list[str], args: list[str]) -> tuple[str, list[str]]:
    """The sweep dir of `-m`, named here (Hydra's default pattern) so that the closing comparison
    finds it, whichever launcher ran the jobs (submitit runs them in other processes); checked
    before any work. Returns it and the arguments for Hydra."""
    import datetime

    from llmtrain.rundir import check_dir

    sweep_dir = _given(overrides, "hydra.sweep.dir")
    if sweep_dir is None:
        sweep_dir = datetime.datetime.now().strftime("multirun/%Y-%m-%d/%H-%M-%S")
        args = [*args, f"hydra.sweep.dir={sweep_dir}"]
    if "${" not in sweep_dir:  # an interpolation is Hydra's to resolve
        check_dir("hydra.sweep.dir", sweep_dir, "sweep dir", "multirun/first")
    return sweep_dir, args


def _plan_run_dir(args: list[str], extra_dir: str | None, config_name: str | None) -> list[str]:
    """Check the dirs a run will write (hydra.run.dir, and out_dir when set) before any work, and
    note those that do not exist yet, so that a refused run removes them again. A name Hydra
    would take from the clock (${now:...}) is fixed here, so that the dir checked is the dir Hydra
    makes. Returns the arguments for Hydra."""
    from hydra._internal.utils import get_args_parser

    from llmtrain.rundir import check_dir

    planned = _planned_dirs(get_args_parser().parse_args(args).overrides, extra_dir, config_name)
    if planned is None:  # the composition fails: validate_overrides says why, in one paragraph
        return args
    raw, run_dir, out_dir = planned
    if "${" in raw and re.fullmatch(r"[\w./:@%+~-]+", run_dir):
        args = [*args, f"hydra.run.dir={run_dir}"]
    check_dir("hydra.run.dir", run_dir)
    if out_dir is not None:
        check_dir("out_dir", out_dir)
    return args


def _planned_dirs(overrides: list[str], extra_dir: str | None, config_name: str | None) -> tuple[str, str, str | None] | None:
    """hydra.run.dir as written and as resolved, and out_dir, for this command line; None when the
    config does not compose or the name does not resolve outside a run."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from llmtrain.config import register_configs

    register_configs()
    search = [f"hydra.searchpath=[file://{Path(extra_dir).expanduser().resolve()}]"] if extra_dir else []
    GlobalHydra.instance().clear()
    previous = HydraConfig.instance().cfg
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="train"):
            node = compose(config_name=config_name or "config", overrides=[*search, *overrides], return_hydra_config=True)
        HydraConfig.instance().set_config(node)  # for a ${hydra:...} in the name
        raw = OmegaConf.to_container(node.hydra.run, resolve=False)["dir"]
        out_dir = node.get("out_dir")
        return str(raw), str(OmegaConf.select(node, "hydra.run.dir")), None if out_dir is None else str(out_dir)
    except Exception:  # noqa: BLE001 - see the docstring
        return None
    finally:
        HydraConfig.instance().cfg = previous
        GlobalHydra.instance().clear()


def flush_denormals_first(overrides: list[str]) -> None:
    """Flush subnormal floats to zero before this process computes anything (flush_denormal=false on
    the command line keeps them). Subnormals make CPU kernels many times slower (a 1024^2 matmul 60x,
    fused AdamW 20x here), and the switch is per thread: torch's thread pools take it from the thread
    that starts them, so setting it later, in train(), reaches the main thread only."""
    import torch

    value = _given(overrides, "flush_denormal")
    torch.set_flush_denormal(value is None or value.strip().lower() not in ("false", "0", "no", "off"))


def _given(overrides: list[str], key: str) -> str | None:
    """The value the command line gives `key` (as key=, +key= or ++key=; the last one wins), or None."""
    values = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith(f"{key}=")]
    return values[-1] if values else None


def _shared_run_dir() -> str:
    """Under torchrun every rank runs Hydra, and each would take its own timestamped run dir. Rank 0
    picks Hydra's default name and hands it to the others through torchrun's own key-value store."""
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
        fail(f"{os.environ.get('WORLD_SIZE')} processes were started (WORLD_SIZE) but they could not agree on a run dir "
             f"({type(err).__name__}: {err}); give one to all of them: hydra.run.dir=PATH.")


def _run_hydra(args: list[str], task: Callable) -> None:
    import hydra

    from llmtrain.config import register_configs

    register_configs()
    sys.argv = ["llmtrain", *args]
    hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(task)()


def _train_task(node) -> float | None:  # node: the composed OmegaConf DictConfig (untyped: imports stay lazy)
    """One run. Returns its objective for sweepers that optimize (Optuna): the final validation
    loss, or the final train loss when the run does not evaluate.

    Hydra's record of the run (.hydra/, train.log) is written only once train() accepts the run
    (conf/config.yaml keeps Hydra from writing it first): a refused run leaves an existing run dir
    as it was, and removes a run dir this command created."""
    from hydra.core.hydra_config import HydraConfig

    from llmtrain import rundir

    hydra_dir = HydraConfig.get().runtime.output_dir
    run_dir = node.get("out_dir") or hydra_dir
    rundir.hold_job_log()
    describe = functools.partial(rundir.describe_run, _hydra_files(node))
    try:
        return _run_task(node, describe)
    except BaseException as stop:
        # Refused (2), or stopped by a signal while setting up (75, or Ctrl-C / a SIGTERM on its way
        # out as a BaseException), before the run was accepted: no dir left behind.
        stopped = not isinstance(stop, SystemExit | Exception) or (
            isinstance(stop, SystemExit) and stop.code in (EXIT_USER_ERROR, EXIT_INTERRUPTED))
        if stopped and not (Path(run_dir) / "config.yaml").exists():
            rundir.discard_created(run_dir)
        raise
    finally:
        if rundir.absolute(run_dir) != rundir.absolute(hydra_dir):  # out_dir elsewhere: Hydra's dir holds nothing
            rundir.discard_created(hydra_dir, only_if_empty=True)


def _hydra_files(task_cfg) -> dict[str, str]:
    """What Hydra writes into `<run dir>/.hydra/` for this job (the task's config, Hydra's own
    config, the task overrides), as texts: taken while HydraConfig is set, written on acceptance."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from llmtrain.rundir import HYDRA_SUBDIR

    hydra_cfg = HydraConfig.instance().cfg
    return {
        f"{HYDRA_SUBDIR}/config.yaml": OmegaConf.to_yaml(task_cfg),
        f"{HYDRA_SUBDIR}/hydra.yaml": OmegaConf.to_yaml(hydra_cfg),
        f"{HYDRA_SUBDIR}/overrides.yaml": OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task),
    }


def _run_task(node, describe: Callable[[Path], None]) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    from llmtrain.config import to_config
    from llmtrain.errors import RunStopped, UserError

    def resume_hint(run_dir: object) -> str:
        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(("hydra.run.dir=", "out_dir="))]
        command = shlex.join(["llmtrain", "train", *overrides, f"hydra.run.dir={run_dir}"])
        return f"To resume exactly where it stopped, run:\n  {command}"

    try:
        _ranks_from_submitit_tasks()
        cfg = to_config(node)
        if cfg.out_dir is None:
            cfg.out_dir = HydraConfig.get().runtime.output_dir
        if cfg.parallel.nproc > 1 and not os.environ.get("WORLD_SIZE"):
            _spawn_workers(cfg, resume_hint, describe)
            from llmtrain.compare import summarize  # the objective, from what rank 0 wrote

            ran = summarize(Path(cfg.out_dir))
            _report_after_run(cfg)
            return ran.final_val_loss if ran.final_val_loss is not None else ran.final_train_loss
        from llmtrain.train import train

        result = train(cfg, on_accept=describe)
        _report_after_run(cfg)
    except UserError as err:
        fail(str(err))
    except RunStopped as stopped:
        from llmtrain.errors import StoppedBeforeStart

        if not isinstance(stopped, StoppedBeforeStart):  # stopped while setting up: the run dir stays as it was
            _report_after_run(cfg)  # an interrupted run is reviewed too
        fail(f"{stopped}\n{resume_hint(stopped.run_dir or cfg.out_dir)}", stopped.exit_code, label="stopped")
    if result.val_losses:
        return result.final_val_loss
    return result.train_losses[max(result.train_losses)] if result.train_losses else None


def _report_after_run(cfg) -> None:
    """`train` ends with the post-run review (report=true), written by rank 0. The run's own results
    are on disk by then: a report that fails is a warning, never a failed run."""
    if not cfg.report or os.environ.get("RANK", "0") != "0" or not (Path(cfg.out_dir) / "metrics.jsonl").is_file():
        return
    from llmtrain.report import render_summary, write_report
    from llmtrain.sinks import default_console

    try:
        render_summary(write_report(Path(cfg.out_dir)), default_console())
    except Exception as err:  # noqa: BLE001 - see the docstring
        print(f"llmtrain: warning: the post-run report could not be written ({type(err).__name__}: {err}); "
              f"`llmtrain report {cfg.out_dir}` retries it.", file=sys.stderr)


def _ranks_from_submitit_tasks() -> None:
    """A job of hydra/launcher=slurm (or submitit_local) with several tasks: each task is one rank,
    as torchrun would set them (RANK, WORLD_SIZE, ...). The rendezvous is the job's first node, on a
    port derived from the job id, so every task of the job finds it and other jobs do not."""
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


def _spawn_workers(cfg, resume_hint: Callable[[object], str], describe: Callable[[Path], None] | None = None) -> None:
    """parallel.nproc=N: start N ranks on this machine under this one Hydra run dir. When a rank
    fails, the others are stopped at once; the exit code is the failing rank's. The ranks run
    without Hydra: rank 0 gets the run's description to write (`describe`, picklable) with its cfg."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    from llmtrain.errors import EXIT_HEALTH_STOP, EXIT_INTERRUPTED, EXIT_NONFINITE_STOP, EXIT_SAVE_FAILED
    from llmtrain.parallel import spawn_local

    try:
        spawn_local(cfg.parallel.nproc, functools.partial(_rank_main, on_accept=describe), cfg)
    except ProcessExitedException as err:
        if err.exit_code == EXIT_ABORTED:  # a second signal: rank 0 said so in its one line
            sys.exit(EXIT_ABORTED)
        if err.signal_name in ("SIGTERM", "SIGINT"):  # it came before the rank had its handlers
            fail(f"stopped by {err.signal_name} while the ranks were starting, before the first step: nothing to save "
                 "yet; the same command starts the run again", EXIT_INTERRUPTED, label="stopped")
        code = err.exit_code if err.exit_code and err.exit_code > 0 else 1
        if code in (EXIT_INTERRUPTED, EXIT_NONFINITE_STOP, EXIT_HEALTH_STOP, EXIT_SAVE_FAILED):
            fail(resume_hint(cfg.out_dir), code, label="stopped")
        if code != 2 or err.error_index != 0:  # rank 0 prints its own user errors
            fail(f"rank {err.error_index} of {cfg.parallel.nproc} exited with code {err.exit_code}; the other ranks were "
                 "stopped", code)
        sys.exit(code)
    except ProcessRaisedException as err:
        fail(f"rank {err.error_index} of {cfg.parallel.nproc} failed and the other ranks were stopped:\n{err.msg.strip()}", 1)


def _rank_main(cfg, on_accept: Callable[[Path], None] | None = None) -> None:
    """One rank started by parallel.nproc: rank 0 prints errors; every rank exits with the code.

    The exit skips interpreter teardown (os._exit after flushing): torch's C++ threads (FSDP2 over
    gloo) can abort it ("terminate called without an active exception") after a run that went
    well. An unexpected exception still propagates, so the parent shows its traceback."""
    from llmtrain.errors import RunStopped, UserError
    from llmtrain.train import train

    main = os.environ.get("RANK") == "0"
    code = 0
    try:
        train(cfg, on_accept=on_accept)
    except UserError as err:
        code = EXIT_USER_ERROR
        if main:
            sys.stderr.write(f"llmtrain: error: {err}\n")
        else:  # a refusal every rank raises together: rank 0 exits first, so the parent shows its paragraph alone
            import time

            time.sleep(2)
    except RunStopped as stopped:
        code = stopped.exit_code
        if main:
            sys.stderr.write(f"llmtrain: stopped: {stopped}\n")
    except KeyboardInterrupt as err:  # a second signal: torch's worker wrapper would turn it into exit 0
        from llmtrain.interrupts import abort_message, announce_abort

        code = EXIT_ABORTED
        if main:
            announce_abort(abort_message(err))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def validate_overrides(
    overrides: list[str], multirun: bool = False, extra_dir: str | None = None, config_name: str | None = None,
    preflight: bool = False,
) -> None:
    """Compose every configuration the command line asks for and validate it; raises ConfigError,
    or CheckFailed (after printing the check's table) when `preflight` finds FAIL rows.

    A sweep (`-m a=1,2 b=x,y`) is expanded the way Hydra's basic sweeper does, so a bad value in
    any job fails before the first job starts. `extra_dir` is `--config-dir`: searched like Hydra does.
    """
    from llmtrain.data.corpus import input_files

    jobs = _expand_sweep(overrides) if multirun else [overrides]
    for job in jobs:
        cfg = compose_config(job, extra_dir, config_name)
        if cfg.data.path is not None and cfg.data.source.value in ("text", "jsonl"):
            input_files(cfg.data.path, cfg.data.source.value)  # a missing corpus fails now, before any run dir
        if cfg.data.source.value == "hf":
            from llmtrain.data.prepare import hf_dataset

            hf_dataset(cfg.data)  # loaded (or refused) now, before any run dir; the run reuses it
        if preflight:
            from llmtrain.check import CheckFailed, render, run_check

            report = run_check(cfg, measure_compute=False)
            if report.failures and not cfg.allow_check_failures:
                from llmtrain.sinks import default_console

                render(report, default_console(stderr=True), estimates=True)
                raise CheckFailed(report.refusal(), report)


def compose_config(overrides: list[str], extra_dir: str | None = None, config_name: str | None = None) -> Config:
    """Compose the shipped config (plus `extra_dir`, like --config-dir) with `overrides` and validate
    it, without starting Hydra's job machinery (no run dir); raises ConfigError."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from llmtrain.config import register_configs, to_config
    from llmtrain.errors import ConfigError

    register_configs()
    search = [f"hydra.searchpath=[file://{Path(extra_dir).expanduser().resolve()}]"] if extra_dir else []
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="train"):
        try:
            node = compose(config_name=config_name or "config", overrides=[*search, *overrides])
        except Exception as err:  # Hydra wraps the cause; turn it into one paragraph
            raise _composition_error(err) from None
    try:
        return to_config(node)
    except ConfigError as err:
        if "Unknown config key" in str(err) and any(o.startswith("+") for o in overrides):
            raise ConfigError(f"{err} ('+key=value' cannot add keys the schema does not define.)") from None
        raise


def _expand_sweep(overrides: list[str]) -> list[list[str]]:
    """The jobs of a basic sweep. Sweeps only a sweeper plugin can expand (interval(), glob()
    without a config loader) keep their key at its composed default here, and are validated by
    each job instead."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as err:
        raise _composition_error(err) from None
    expandable = [
        o for o in parsed if not o.is_sweep_override() or (o.is_discrete_sweep() and not isinstance(o.value(), Glob))
    ]
    try:
        batches = BasicSweeper.split_arguments(expandable, None)
    except Exception as err:
        raise _composition_error(err) from None
    return [list(job) for batch in batches for job in batch]


def _composition_error(err: Exception) -> Exception:
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    from llmtrain.config import describe_omegaconf_error
    from llmtrain.errors import ConfigError

    if isinstance(err, MissingConfigException):
        missing = err.missing_cfg_file or ""
        group, _, option = missing.rpartition("/")
        if err.options and group:
            return ConfigError(
                f"Unknown option '{option}' for config group '{group}'. Valid options: {', '.join(sorted(err.options))} "
                f"(e.g. {group}={sorted(err.options)[0]})."
            )
        return ConfigError(" ".join(str(err).split()))
    if isinstance(err, OverrideParseException):
        return ConfigError(f"Cannot parse the command-line override: {' '.join(str(err).split())}")
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, OmegaConfBaseException):
            return ConfigError(describe_omegaconf_error(cause))
        cause = cause.__cause__ or cause.__context__
    return ConfigError(" ".join(str(err).split()))


def train_help() -> str:
    """Groups with their options, then every key with its default and one-line doc."""
    import dataclasses

    import yaml

    from llmtrain.config import GROUPS, Config, config_to_dict, field_type, schema_fields

    root = conf_dir()
    defaults = {}
    for entry in yaml.safe_load((root / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict):
            defaults.update(entry)
    lines = [
        "usage: llmtrain train [GROUP=OPTION ...] [KEY=VALUE ...] [-m] [--cfg job|hydra|all] [--info] [--hydra-help]",
        "",
        "Compose a config from the groups below, override any key, and train. Examples:",
        "  llmtrain train model=gpt_small optim=sgd optim.lr=0.05",
        "  llmtrain train -m optim.lr=1e-3,3e-4 max_steps=20      # a sweep: one run dir per job",
        "  llmtrain train data=text data.path=corpus.txt data.tokenizer=char --cfg job",
        "  llmtrain train preset=[stable,fast]                     # presets: checklist items switched on",
        "",
        "Config groups (default marked *):",
    ]
    for group in (*GROUPS, "preset"):
        options = sorted(p.stem for p in (root / group).glob("*.yaml"))
        shown = ", ".join(f"{o}*" if o == defaults.get(group) else o for o in options)
        lines.append(f"  {group:<11} {shown}")
    lines += ["", "Keys (defaults of the schema; a group option sets its own values):"]

    def walk(schema: type, prefix: str, values: dict) -> None:
        for name, fld in schema_fields(schema).items():
            tp = field_type(fld.type)
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.", values[name])
                continue
            value = values[name]
            shown = "null" if value is None else str(value)
            lines.append(f"  {prefix + name:<33} {shown:<12} {fld.metadata.get('help', '')}")

    walk(Config, "", config_to_dict(Config()))
    lines += [
        "",
        "Hydra: -m/--multirun, --cfg job, --info, hydra.run.dir=PATH, -sc install=bash (shell completion),",
        "       -cd DIR (your own group options, e.g. DIR/model/mine.yaml -> model=mine).",
        "Full Hydra help: llmtrain train --hydra-help",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------------------------


def prepare_command(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="llmtrain prepare",
        description="Tokenize the data a config names into cached memory-mapped token files (train and val), once: "
        "unchanged inputs are reused, changed inputs rebuilt. `llmtrain train` does this itself when needed.",
        epilog="examples: llmtrain prepare data=text data.path=corpus/ data.tokenizer=bpe data.bpe_vocab_size=8192\n"
        "          llmtrain prepare data=jsonl data.path='dumps/*.jsonl' data.text_field=content",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, as for `llmtrain train` (data=..., data.path=...)")
    parser.add_argument("--config-dir", "-cd", default=None, help="a folder of your own group options (as for train)")
    opts = parser.parse_args(args)
    if opts.config_dir and not Path(opts.config_dir).expanduser().is_dir():
        fail(f"--config-dir is '{opts.config_dir}', which is not a folder; give a folder of group options like conf/.")

    from rich.markup import escape

    from llmtrain.data.prepare import prepare_data
    from llmtrain.errors import UserError
    from llmtrain.sinks import default_console

    console = default_console()
    try:
        cfg = compose_config(opts.overrides, opts.config_dir)
        data = prepare_data(cfg.data, log=lambda message: console.print(f"[dim]{escape(message)}[/]"), progress=True)
    except UserError as err:
        fail(str(err))
    m = data.meta
    console.print(
        f"prepared [bold]{cfg.data.source.value}[/] data in {data.directory}\n"
        f"  {m['documents']:,} document{'s' if m['documents'] != 1 else ''}, {m['source_bytes']:,} bytes -> {m['train_tokens']:,} train / "
        f"{m['val_tokens']:,} val tokens ({m['dtype']})\n"
        f"  tokenizer {m['tokenizer']}, vocabulary {m['vocab_size']:,}; unigram entropy "
        f"{m['unigram_entropy_nats']:.4f} nats/token (the loss to beat)"
    )


# ---------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------


def check_command(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="llmtrain check",
        description="Run the pre-flight checklist (settings that make training stable, plus static checks of the model "
        "and data) on a config, with a memory and "
        "compute estimate for this machine. Takes the same overrides as `llmtrain train`. "
        "Exit code: 0 all items pass, 1 warnings, 2 failures (or a bad config).",
        epilog="example: llmtrain check model=gpt_small optim=adamw precision=fp16",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, as for `llmtrain train` (GROUP=OPTION, KEY=VALUE)")
    parser.add_argument("--config-dir", "-cd", default=None, help="a folder of your own group options (as for train)")
    parser.add_argument("--no-compute", action="store_true", help="skip the matmul measurement and the time estimate")
    opts = parser.parse_args(args)
    if opts.config_dir and not Path(opts.config_dir).expanduser().is_dir():
        fail(f"--config-dir is '{opts.config_dir}', which is not a folder; give a folder of group options like conf/.")

    from llmtrain.check import render, run_check
    from llmtrain.errors import UserError

    try:
        cfg = compose_config(opts.overrides, opts.config_dir)
        report = run_check(cfg, measure_compute=not opts.no_compute)
    except UserError as err:
        fail(str(err))
    render(report)
    sys.exit(report.exit_code)


# ---------------------------------------------------------------------------------------------
# sample
# ---------------------------------------------------------------------------------------------


def sample_command(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="llmtrain sample", description="Generate text from a trained run.")
    parser.add_argument("run_dir", type=Path, help="run directory written by `llmtrain train`")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--max-new-tokens", type=int, default=400, help="tokens to generate (default 400)")
    # The model's own distribution by default: a small byte-level model sampled colder (or top-k
    # truncated) falls into its most likely loop, e.g. endless runs of indentation spaces.
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy (default 1.0)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens only (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed: same seed, same text (default 0)")
    parser.add_argument("--ignore-end-of-text", action="store_true",
                        help="keep generating past the end-of-text token (by default the text ends there: the model "
                        "says its document is over)")
    opts = parser.parse_args(args)
    if opts.max_new_tokens < 1:
        fail(f"--max-new-tokens is {opts.max_new_tokens}; it must be >= 1.")
    if opts.top_k is not None and opts.top_k < 1:
        fail(f"--top-k is {opts.top_k}; it must be >= 1.")

    from llmtrain.errors import UserError
    from llmtrain.sample import sample_text

    try:
        text = sample_text(opts.run_dir, opts.prompt, opts.max_new_tokens, opts.temperature, opts.top_k, opts.seed,
                           stop_at_end_of_text=not opts.ignore_end_of_text)
    except UserError as err:
        fail(str(err))
    sys.stdout.write(opts.prompt + text + "\n")


def export_command(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="llmtrain export", description="Export a run's weights for inference.")
    parser.add_argument("run_dir", type=Path, help="run directory written by `llmtrain train`")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: RUN_DIR/export)")
    opts = parser.parse_args(args)

    from llmtrain.errors import UserError
    from llmtrain.export import export_run

    try:
        out = export_run(opts.run_dir, opts.out)
    except UserError as err:
        fail(str(err))
    print(f"exported to {out}: model.safetensors, model_config.json, tokenizer.json (sample it: llmtrain sample {out})")


# ---------------------------------------------------------------------------------------------
# shell completion
# ---------------------------------------------------------------------------------------------


def _complete(args: list[str]) -> None:
    """Hydra's completion script calls `llmtrain -sc query=SHELL` with COMP_LINE set.

    The subcommand word is ours, not Hydra's: complete it here, or strip it from COMP_LINE and let
    Hydra complete the overrides of that command.
    """
    line = os.environ.get("COMP_LINE", "")
    words = line.split()
    if not words:  # `llmtrain -sc install=bash`: Hydra prints the script that calls us back
        _run_hydra(args, _train_task)
        return
    completing_command = len(words) == 1 or (len(words) == 2 and not line.endswith(" "))
    if completing_command:
        prefix = words[1] if len(words) == 2 else ""
        print(" ".join(c for c in COMMANDS if c.startswith(prefix)))
        return
    if words[1] != "train":
        return
    os.environ["COMP_LINE"] = re.sub(r"^(\s*\S+\s+)train\b", r"\1", line)
    os.environ["COMP_POINT"] = str(len(os.environ["COMP_LINE"]))
    _run_hydra(args, _train_task)


# ---------------------------------------------------------------------------------------------
# compare
# ---------------------------------------------------------------------------------------------


def compare_command(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="llmtrain compare",
        description="Compare the runs of a sweep (`llmtrain train -m ...`): overrides, final train/val loss, best "
        "val loss and step, alarms, tokens/s, status; sorted by final val loss. Writes compare.csv and compare.png "
        "(loss curves) into the sweep dir.",
        epilog="example: llmtrain train -m optim.lr=1e-3,3e-3,1e-2 max_steps=200 && llmtrain compare multirun/<date>/<time>",
    )
    parser.add_argument("sweep_dir", type=Path, help="the sweep dir (or any folder of run dirs)")
    parser.add_argument("--csv", type=Path, default=None, help="where the CSV goes (default: <sweep dir>/compare.csv)")
    parser.add_argument("--png", type=Path, default=None, help="where the plot goes (default: <sweep dir>/compare.png)")
    opts = parser.parse_args(args)

    from rich.table import Table

    from llmtrain.compare import COLUMNS, compare_runs, plot_curves, rows, write_csv
    from llmtrain.errors import UserError
    from llmtrain.sinks import default_console

    try:
        summaries, common = compare_runs(opts.sweep_dir)
    except UserError as err:
        fail(str(err))
    csv_path = opts.csv or opts.sweep_dir / "compare.csv"
    png_path = opts.png or opts.sweep_dir / "compare.png"
    title = f"{len(summaries)} run{'s' if len(summaries) != 1 else ''} in {opts.sweep_dir}"
    table = Table(title=title, caption=f"common to all: {' '.join(common)}" if common else None, title_justify="left",
                  caption_justify="left")
    for column in COLUMNS:
        table.add_column(column, overflow="fold")
    for row in rows(summaries, opts.sweep_dir):
        table.add_row(*row)
    console = default_console()
    console.print(table)
    write_csv(summaries, opts.sweep_dir, csv_path)
    plot_curves(summaries, png_path, title + (f"\ncommon: {' '.join(common)}" if common else ""))
    console.print(f"wrote {csv_path} and {png_path}")


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def report_command(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="llmtrain report",
        description="The post-run review of a run dir, finished, interrupted or crashed: is the loss smooth, "
        "does validation track training, does inference behave like training, peak memory and headroom, time per "
        "step and its bottleneck, alarms and actions. Writes report.md and a self-contained report.html (plots "
        "inside) into the run dir and prints the verdicts. `llmtrain train` writes it at the end of every run.",
        epilog="example: llmtrain report outputs/2026-11-30/10-00-00",
    )
    parser.add_argument("run_dir", type=Path, help="a run dir written by `llmtrain train`")
    parser.add_argument("--no-inference", action="store_true",
                        help="skip reloading the weights for the inference-vs-training check")
    opts = parser.parse_args(args)

    from llmtrain.errors import UserError
    from llmtrain.report import render_summary, write_report
    from llmtrain.sinks import default_console

    console = default_console()
    try:
        report = write_report(opts.run_dir, inference=not opts.no_inference)
    except UserError as err:
        fail(str(err))
    render_summary(report, console)


# ---------------------------------------------------------------------------------------------
# doctor
# ---------------------------------------------------------------------------------------------


def doctor_command(args: list[str]) -> None:
    import argparse

    from llmtrain.doctor import EXPERIMENTS

    parser = argparse.ArgumentParser(
        prog="llmtrain doctor",
        description="Diagnostic experiments on a config (the same overrides as `llmtrain train`):\n"
        + "\n".join(f"  {name}: {doc}" for name, doc in EXPERIMENTS.items())
        + "\nExit code 0: the experiment passed; 1: it found a problem (the output says which and what to check).",
        epilog="examples: llmtrain doctor overfit\n          llmtrain doctor lr-range optim=adamw model.n_layer=4\n"
        "          llmtrain doctor grad-check model.dropout=0.1",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("experiment", choices=list(EXPERIMENTS), help="which experiment to run")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for `llmtrain train` (GROUP=OPTION, KEY=VALUE)")
    parser.add_argument("--config-dir", "-cd", default=None, help="a folder of your own group options (as for train)")
    parser.add_argument("--out", type=Path, default=Path("doctor"),
                        help="where plots and results go (default: ./doctor)")
    opts = parser.parse_args(args)
    if opts.config_dir and not Path(opts.config_dir).expanduser().is_dir():
        fail(f"--config-dir is '{opts.config_dir}', which is not a folder; give a folder of group options like conf/.")

    from llmtrain.doctor import run_doctor
    from llmtrain.errors import UserError
    from llmtrain.sinks import default_console

    flush_denormals_first(opts.overrides)  # as train does: the doctor's steps are the train loop's
    try:
        cfg = compose_config(opts.overrides, opts.config_dir)
        code = run_doctor(opts.experiment, cfg, opts.out, default_console())
    except UserError as err:
        fail(str(err))
    sys.exit(code)
