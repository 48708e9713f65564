"""What ends a command early, and with which exit code: a `UserError` (a mistake the user can fix) is
printed as one paragraph and exits 2; a `RunStopped` (a run that ended early on purpose, after
saving) exits with its own code (75 stopped on request, 74 a save failed, 4 a health stop, 3 a
non-finite stop)."""


class UserError(Exception):
    """A mistake the user can fix (bad input, missing file); never shown with a traceback."""


class ConfigError(UserError, ValueError):
    """A bad configuration value or combination."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used: names the folder, the file and what is wrong."""


class CheckpointSaveError(Exception):
    """A save that failed (disk full, permissions); the previous checkpoints are intact."""


# Exit codes of `llmtrain train` (documented in docs/checkpointing.md).
EXIT_OK = 0
EXIT_USER_ERROR = 2
EXIT_NONFINITE_STOP = 3
EXIT_HEALTH_STOP = 4
EXIT_SAVE_FAILED = 74  # EX_IOERR: a save could not be written (disk full); the newest good checkpoint resumes
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: stopped on request after saving; the same command resumes
EXIT_ABORTED = 130  # a second Ctrl-C: stopped at once, nothing saved


class RunStopped(Exception):
    """The run ended early on purpose, after saving a checkpoint; `exit_code` says why."""

    exit_code = 1

    def __init__(self, message: str, checkpoint: object = None, run_dir: object = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.run_dir = run_dir


class Interrupted(RunStopped):
    """SIGTERM or Ctrl-C: the current step finished and was saved."""

    exit_code = EXIT_INTERRUPTED


class StoppedBeforeStart(Interrupted):
    """SIGTERM while setting up, before the first step: nothing trained, nothing to save (exit 75);
    the same command starts the run. The run dir is as it was (no report is written)."""


class SaveFailed(RunStopped):
    """A save that had to succeed did not (on_save_error=stop, or the final model.pt): nothing
    written before is lost, and `checkpoint` is the newest good one to resume from (or None)."""

    exit_code = EXIT_SAVE_FAILED


class NonFiniteStop(RunStopped):
    """A NaN/Inf the on_nonfinite policy could not (or was told not to) recover from."""

    exit_code = EXIT_NONFINITE_STOP


class HealthStop(RunStopped):
    """A health alarm whose configured action is `stop` (monitor.actions)."""

    exit_code = EXIT_HEALTH_STOP
