"""`llmtrain train`: Hydra's command line, checked before Hydra starts, and the Hydra task.

`train` hands its arguments to Hydra unchanged (overrides, `-m`, `--cfg`, `--info`,
`hydra.run.dir=...`, `-sc`), but first composes each requested configuration itself and validates
it (llmtrain.cli.compose), and checks the run dirs it will write, so a bad value or an unwritable
dir fails with exit code 2 and one readable paragraph before any work starts, instead of Hydra's
exit 1 and stack-trace hint. This is where Hydra and OmegaConf end: the task converts the composed
node into a typed Config and hands it to training (one process, or the ranks llmtrain.training.launch
starts).
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.cli.commands import compare_command
from llmtrain.cli.common import (
    check_config_dir,
    conf_dir,
    fail,
    flush_denormals_first,
    given,
    parse_command_line,
    release_signals,
    signal_stop,
    signals_held,
)
from llmtrain.cli.compose import upgrade_overrides, validate_overrides
from llmtrain.core import files
from llmtrain.core.errors import (
    EXIT_INTERRUPTED,
    EXIT_USER_ERROR,
    Interrupted,
    RunStopped,
    StoppedBeforeStart,
    UserError,
)
from llmtrain.training.launch import RanksStopped, ranks_from_submitit_tasks, run_local_ranks, shared_run_dir

if TYPE_CHECKING:
    from llmtrain.config.schema import Config


def train_command(args: list[str]) -> None:
    """`llmtrain train ARGS`: refuse what cannot work, plan and check the run dirs, validate every
    job, then hand ARGS to Hydra; a sweep ends with its comparison table."""
    from hydra._internal.utils import get_args_parser

    args = upgrade_overrides(args)  # `report=false` and the like, before Hydra parses them
    parser = get_args_parser()
    parser.prog = "llmtrain train"
    parsed = parse_command_line(parser, args)  # `--max_steps 30` is refused with the override it means
    if parsed.help:
        print(train_help(parsed.config_dir))
        return
    if parsed.multirun and (parsed.cfg or parsed.info):
        fail("-m/--multirun cannot be combined with --cfg or --info; drop -m to print one job's config.")
    if parsed.config_path:
        fail(
            f"--config-path ({parsed.config_path}) is not supported: llmtrain ships its own primary config. "
            "Add your own group options with --config-dir DIR (-cd DIR), e.g. DIR/model/mine.yaml then model=mine."
        )
    check_config_dir(parsed.config_dir)
    launched = int(os.environ.get("WORLD_SIZE") or 1)
    if launched > 1 and parsed.multirun:
        fail(f"-m/--multirun under torchrun ({launched} processes): each rank would run the whole sweep. Sweep "
             "from one process with parallel.nproc=N per job, or launch one torchrun per setting.")
    if launched > 1 and not parsed.shell_completion and given(parsed.overrides, "hydra.run.dir") is None:
        try:
            args = [*args, f"hydra.run.dir={shared_run_dir()}"]  # torchrun: one run dir for all ranks
        except UserError as err:
            fail(str(err))
    runs = not parsed.shell_completion and not parsed.hydra_help and not (parsed.cfg or parsed.info)
    sweep_dir, run_dirs = None, []
    if runs:
        try:  # before any work: a run dir that cannot be written is a mistake like a bad value
            if parsed.multirun:
                sweep_dir, args = _plan_sweep_dir(parsed.overrides, args)
            else:
                args, run_dirs = _plan_run_dir(args, parsed.config_dir, parsed.config_name)
        except UserError as err:
            fail(str(err))
    if not parsed.shell_completion and not parsed.hydra_help:
        flush_denormals_first(parsed.overrides)
        try:
            validate_overrides(
                parsed.overrides, multirun=parsed.multirun, extra_dir=parsed.config_dir, config_name=parsed.config_name,
                preflight=not (parsed.cfg or parsed.info),
            )
        except UserError as err:
            fail(str(err))
    try:
        run_hydra(args, train_task)
    except BaseException:
        # Refused, or stopped before a run was accepted: a dir this command made goes if it holds no run.
        # train_task removes its run's own; this also covers a signal landing between Hydra making the
        # run dir and the task's start, and a new sweep dir left with nothing but Hydra's multirun.yaml.
        from llmtrain.core.rundir import discard_created

        for made in ([sweep_dir] if sweep_dir is not None else run_dirs):
            discard_created(made, only_if_empty=True, keep=frozenset({"multirun.yaml"} if sweep_dir else ()))
        raise
    if sweep_dir is not None and os.environ.get("RANK", "0") == "0" and Path(sweep_dir).is_dir():
        compare_command([sweep_dir])  # a sweep ends with its comparison table


def _plan_sweep_dir(overrides: list[str], args: list[str]) -> tuple[str, list[str]]:
    """The sweep dir of `-m`, named here (Hydra's default pattern) so that the closing comparison
    finds it, whichever launcher ran the jobs (submitit runs them in other processes); checked
    before any work. Returns it and the arguments for Hydra."""
    import datetime

    from llmtrain.core.rundir import check_dir

    sweep_dir = given(overrides, "hydra.sweep.dir")
    if sweep_dir is None:
        sweep_dir = datetime.datetime.now().strftime("multirun/%Y-%m-%d/%H-%M-%S")
        args = [*args, f"hydra.sweep.dir={sweep_dir}"]
    if "${" not in sweep_dir:  # an interpolation is Hydra's to resolve
        check_dir("hydra.sweep.dir", sweep_dir, "sweep dir", "multirun/first")
    return sweep_dir, args


def _plan_run_dir(args: list[str], extra_dir: str | None, config_name: str | None) -> tuple[list[str], list[Path]]:
    """Check the dirs a run will write (hydra.run.dir, and out_dir when set) before any work, and
    note those that do not exist yet, so that a refused run removes them again. A name Hydra
    would take from the clock (${now:...}) is fixed here, so that the dir checked is the dir Hydra
    makes. Returns the arguments for Hydra and the dirs checked."""
    from hydra._internal.utils import get_args_parser

    from llmtrain.core.rundir import check_dir

    planned = _planned_dirs(get_args_parser().parse_args(args).overrides, extra_dir, config_name)
    if planned is None:  # the composition fails: validate_overrides says why, in one paragraph
        return args, []
    raw, run_dir, out_dir = planned
    if "${" in raw and re.fullmatch(r"[\w./:@%+~-]+", run_dir):
        args = [*args, f"hydra.run.dir={run_dir}"]
    checked = [check_dir("hydra.run.dir", run_dir)]
    if out_dir is not None:
        checked.append(check_dir("out_dir", out_dir))
    return args, checked


def _planned_dirs(overrides: list[str], extra_dir: str | None,
                  config_name: str | None) -> tuple[str, str, str | None] | None:
    """hydra.run.dir as written and as resolved, and out_dir, for this command line; None when the
    config does not compose or the name does not resolve outside a run."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from llmtrain.config.hydra import register_configs

    register_configs()
    search = [f"hydra.searchpath=[file://{Path(extra_dir).expanduser().resolve()}]"] if extra_dir else []
    GlobalHydra.instance().clear()
    previous = HydraConfig.instance().cfg
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="train"):
            node = compose(config_name=config_name or "config", overrides=[*search, *overrides],
                           return_hydra_config=True)
        HydraConfig.instance().set_config(node)  # for a ${hydra:...} in the name
        raw = OmegaConf.to_container(node.hydra.run, resolve=False)["dir"]
        out_dir = node.get("out_dir")
        return str(raw), str(OmegaConf.select(node, "hydra.run.dir")), None if out_dir is None else str(out_dir)
    except Exception:  # noqa: BLE001 - see the docstring
        return None
    finally:
        HydraConfig.instance().cfg = previous
        GlobalHydra.instance().clear()


def run_hydra(args: list[str], task: Callable) -> None:
    """Hand `args` to Hydra's own command line (as if typed after `llmtrain`), with the shipped
    config groups registered: Hydra runs `task` once per job, or answers -sc/--cfg/--info itself."""
    import hydra

    from llmtrain.config.hydra import register_configs

    register_configs()
    sys.argv = ["llmtrain", *args]
    with signals_held():  # Hydra composes the job's config uninterrupted (a signal cutting it half-way would end in
        # Hydra's own traceback); the task takes the signals from its first line (train_task)
        hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(task)()


def train_task(node) -> float | None:  # node: the composed OmegaConf DictConfig (untyped: imports stay lazy)
    """One run. Returns its objective for sweepers that optimize (Optuna): the final validation
    loss, or the final train loss when the run does not evaluate.

    Hydra's record of the run (.hydra/, train.log) is written only once train() accepts the run
    (conf/config.yaml keeps Hydra from writing it first): a refused run leaves an existing run dir
    as it was, and removes a run dir this command created."""
    from hydra.core.hydra_config import HydraConfig

    from llmtrain.core import rundir

    hydra_dir = HydraConfig.get().runtime.output_dir
    run_dir = node.get("out_dir") or hydra_dir
    rundir.hold_job_log()
    describe = functools.partial(rundir.describe_run, _hydra_files(node))
    try:
        release_signals()  # held since run_hydra: a signal that came while Hydra composed is taken now
        return _run_task(node, describe)
    except BaseException as stop:
        # Refused (2), or stopped by a signal while setting up (75, or Ctrl-C / a SIGTERM on its way
        # out as a BaseException, maybe turned into another error by the code it cut), before the run
        # was accepted: no dir left behind.
        by_signal = signal_stop(stop)
        stopped = by_signal is not None or (isinstance(stop, SystemExit)
                                            and stop.code in (EXIT_USER_ERROR, EXIT_INTERRUPTED))
        if stopped and not (Path(run_dir) / files.CONFIG).exists():
            rundir.discard_created(run_dir)
        # the signal goes on, not Hydra's traceback of what it became
        if by_signal is not None and by_signal is not stop:
            raise by_signal from None
        raise
    finally:
        if rundir.absolute(run_dir) != rundir.absolute(hydra_dir):  # out_dir elsewhere: Hydra's dir holds nothing
            rundir.discard_created(hydra_dir, only_if_empty=True)


def _hydra_files(task_cfg) -> dict[str, str]:
    """What Hydra writes into `<run dir>/.hydra/` for this job (the task's config, Hydra's own
    config, the task overrides), as texts: taken while HydraConfig is set, written on acceptance."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from llmtrain.core.files import HYDRA_SUBDIR

    hydra_cfg = HydraConfig.instance().cfg
    return {
        f"{HYDRA_SUBDIR}/config.yaml": OmegaConf.to_yaml(task_cfg),
        f"{HYDRA_SUBDIR}/hydra.yaml": OmegaConf.to_yaml(hydra_cfg),
        f"{HYDRA_SUBDIR}/overrides.yaml": OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task),
    }


def _run_task(node, describe: Callable[[Path], None]) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    from llmtrain.config.hydra import to_config
    from llmtrain.hf.init import apply_init_from, explicit_keys

    applied: dict[str, str] = {}  # the memory_saver preset's overrides, once applied: part of the run's config

    def resume_hint(run_dir: object) -> str:
        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(("hydra.run.dir=", "out_dir="))]
        overrides += [f"{key}={value}" for key, value in applied.items()]
        command = shlex.join(["llmtrain", "train", *overrides, f"hydra.run.dir={run_dir}"])
        return f"To resume exactly where it stopped, run:\n  {command}"

    try:
        ranks_from_submitit_tasks()
        cfg = to_config(node, resolve=lambda c: apply_init_from(c, explicit_keys(HydraConfig.get().overrides.task)))
        if cfg.out_dir is None:
            cfg.out_dir = HydraConfig.get().runtime.output_dir
        cfg = _apply_memory_saver(cfg, applied)  # before any rank starts: every rank gets the same config
        if cfg.parallel.nproc > 1 and not os.environ.get("WORLD_SIZE"):
            return _train_on_local_ranks(cfg, resume_hint, describe)
        from llmtrain.training.loop import train

        result = train(cfg, on_accept=describe)
        _report_after_run(cfg)
    except UserError as err:
        fail(str(err))
    except RunStopped as stopped:
        if not isinstance(stopped, StoppedBeforeStart):  # stopped while setting up: the run dir stays as it was
            # A stop by an alarm, a NaN or a failed save is reviewed; one asked for (a signal) leaves at once.
            _report_after_run(cfg, later=isinstance(stopped, Interrupted))
        fail(f"{stopped}\n{resume_hint(stopped.run_dir or cfg.out_dir)}", stopped.exit_code, label="stopped")
    if result.val_losses:
        return result.final_val_loss
    return result.train_losses[max(result.train_losses)] if result.train_losses else None


def _apply_memory_saver(cfg: Config, applied: dict[str, str]) -> Config:
    """memory_saver=true (preset=memory_saver): the config with the cheapest saver that fits this
    device applied (preflight/savers.py), and its one line printed; the overrides go into `applied`
    for the resume command. Under torchrun, rank 0 prints."""
    if not cfg.memory_saver:
        return cfg
    from llmtrain.preflight.savers import apply_memory_saver

    cfg, line, overrides = apply_memory_saver(cfg)
    applied.update(overrides)
    if line and os.environ.get("RANK", "0") == "0":
        print(line, flush=True)
    return cfg


def _train_on_local_ranks(cfg: Config, resume_hint: Callable[[object], str],
                          describe: Callable[[Path], None]) -> float | None:
    """parallel.nproc=N: the ranks train (llmtrain.training.launch); this process exits with a
    failed rank's code, or reads their results, writes the review and returns the run's objective."""
    try:
        run_local_ranks(cfg, resume_hint, describe)
    except RanksStopped as stopped:
        if stopped.message is None:  # rank 0 has printed why
            sys.exit(stopped.exit_code)
        fail(stopped.message, stopped.exit_code, label=stopped.label)
    from llmtrain.runs.compare import summarize

    ran = summarize(Path(cfg.out_dir))
    _report_after_run(cfg)
    return ran.final_val_loss if ran.final_val_loss is not None else ran.final_train_loss


def _report_after_run(cfg: Config, later: bool = False) -> None:
    """`train` ends with the post-run review (report.enabled), written by rank 0 and printed as
    report.console says. The run's own results are on disk by then: a report that fails is a
    warning, never a failed run. `later`: a run stopped on request gets a line instead, since the
    review (plots, the weights reloaded) takes as long as several steps and the user is waiting."""
    if (not cfg.report.enabled or os.environ.get("RANK", "0") != "0"
            or not (Path(cfg.out_dir) / files.METRICS).is_file()):
        return
    from llmtrain.core.console import default_console

    if later:
        default_console().print(f"post-run review: not written, to stop promptly; `llmtrain report {cfg.out_dir}` "
                                "writes it", markup=False, highlight=False)
        return
    from llmtrain.runs.report import write_report
    from llmtrain.runs.report.render import render_console

    try:
        render_console(write_report(Path(cfg.out_dir)), default_console(), cfg.report.console.value)
    except Exception as err:  # noqa: BLE001 - see the docstring
        print(f"llmtrain: warning: the post-run report could not be written ({type(err).__name__}: {err}); "
              f"`llmtrain report {cfg.out_dir}` retries it.", file=sys.stderr)


def train_help(config_dir: str | None = None) -> str:
    """Groups with their options (llmtrain.config.catalog, as `llmtrain configs` lists them, with
    `config_dir`'s own), then every key with its default and one-line doc."""
    from llmtrain.config.catalog import catalog, schema_keys

    groups = catalog(conf_dir(), Path(config_dir).expanduser() if config_dir else None)
    lines = [
        "usage: llmtrain train [GROUP=OPTION ...] [KEY=VALUE ...] [-m] [--cfg job|hydra|all] [--info] [--hydra-help]",
        "",
        "Compose a config from the groups below, override any key, and train. Examples:",
        "  llmtrain train model=gpt_small optim=sgd optim.lr=0.05",
        "  llmtrain train -m optim.lr=1e-3,3e-4 max_steps=20      # a sweep: one run dir per job",
        "  llmtrain train data=text data.path=corpus.txt data.tokenizer=char --cfg job",
        "  llmtrain train preset=[stable,fast]                     # presets: checklist items switched on",
        "",
        "Config groups (default marked *; `llmtrain configs` describes each option, `llmtrain configs model=gpt_small` "
        "prints its YAML):",
    ]
    width = max(len(g.name) for g in groups)
    for group in groups:
        shown = ", ".join(f"{o.name}{'*' if o.is_default else ''}" for o in group.options if not o.shadowed)
        lines.append(f"  {group.name:<{width}} {shown}")
    lines += ["", "Keys (defaults of the schema; a group option sets its own values):"]
    lines += [f"  {key:<33} {default:<12} {doc}" for key, default, doc in schema_keys()]
    lines += [
        "",
        "Hydra: -m/--multirun, --cfg job, --info, hydra.run.dir=PATH, -sc install=bash (shell completion),",
        "       -cd DIR (your own group options, e.g. DIR/model/mine.yaml -> model=mine).",
        "Full Hydra help: llmtrain train --hydra-help",
    ]
    return "\n".join(lines)
