"""The `threads` setting read: `auto` (or null) or a count of threads per process; and the one
paragraph a bad value gets. How many cores `auto` then picks is distributed/cores.py's job."""

from __future__ import annotations

AUTO = "auto"


def parse_threads(value: object) -> int | None:
    """The `threads` setting as a count, or None for auto (`auto`, or null from an older config).
    A count given as a string ("4": a quoted override) is a count too. ValueError when neither."""
    if value is None or (isinstance(value, str) and value.strip().lower() == AUTO):
        return None
    if isinstance(value, bool):  # bool is an int to Python; `threads=true` is no count
        raise ValueError(str(value).lower())
    if isinstance(value, int):
        count = value
    elif isinstance(value, str) and value.strip().lstrip("+").isdigit():
        count = int(value.strip())
    else:
        raise ValueError(str(value))
    if count < 1:
        raise ValueError(str(count))
    return count


def threads_error(value: object) -> str | None:
    """The one paragraph a bad `threads` value gets (None: the value is good)."""
    try:
        parse_threads(value)
    except ValueError as err:
        return (f"'threads' is {err}; use auto (the default: count the CPU cores other processes leave free at "
                "start-up and use those), a number of threads per process >= 1 (e.g. threads=2), or null (the "
                "same as auto).")
    return None
