"""User-facing errors: the CLI prints their message as one paragraph and exits with code 2."""


class UserError(Exception):
    """A mistake the user can fix (bad input, missing file); never shown with a traceback."""


class ConfigError(UserError, ValueError):
    """A bad configuration value or combination."""
