"""Reading files llmtrain did not necessarily write, within bounds.

A run dir, an export, a Hugging Face folder or a task file can come from anyone. Whatever llmtrain
reads from them goes through here, so that no file can make a command hang or exhaust memory: only
regular files are opened (a FIFO would block forever, /dev/zero never ends), each kind of file has a
size limit that is checked before it is read, JSON and YAML nested past the parser's depth are
refused, and YAML whose aliases expand to more values than any config holds (a "billion laughs"
file: nine lines, 10^9 values) is refused before anything walks it. Every refusal is an
`UnreadableFile` (a `ConfigError`: one paragraph, exit 2) naming the file and what is wrong with it.
"""

from __future__ import annotations

import itertools
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmtrain.core.errors import ConfigError

MB = 1 << 20
# Limits by what a file is: far above any real one (GPT-2's config.json is 1 KB, a composed
# config.yaml 5 KB, Llama 3's tokenizer.json 9 MB, a 70B model's safetensors index 70 KB).
CONFIG_BYTES = 8 * MB
TOKENIZER_BYTES = 256 * MB
# A YAML or JSON config holds a few hundred values; aliases may repeat blocks, not multiply them.
MAX_VALUES = 100_000


class UnreadableFile(ConfigError):
    """A file that cannot be read safely: not a regular file, too large, not text, not parseable (a
    ConfigError: what the command was given is unusable, exit 2)."""


def regular_file_problem(path: Path) -> str | None:
    """Why `path` is not a readable regular file ("does not exist", "is a folder", "is a FIFO ..."), or None."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as err:
        return f"cannot be read ({err.strerror or type(err).__name__})"
    if stat.S_ISDIR(mode):
        return "is a folder, not a file"
    if not stat.S_ISREG(mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        return f"is {kind}, not a regular file"
    if not os.access(path, os.R_OK):
        return "is not readable (permission denied)"
    return None


def require_regular_file(path: Path, what: str) -> None:
    problem = regular_file_problem(Path(path))
    if problem is not None:
        raise UnreadableFile(f"{path} ({what}) {problem}.")


def read_bytes(path: Path, what: str, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes."""
    path = Path(path)
    require_regular_file(path, what)
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except OSError as err:
        raise UnreadableFile(f"{path} ({what}) cannot be read ({err.strerror or type(err).__name__}).") from None
    if len(data) > limit:
        raise UnreadableFile(f"{path} ({what}) is larger than {_size(limit)}, far more than such a file holds; it is "
                             "not what it claims to be.")
    return data


def read_text(path: Path, what: str, limit: int = CONFIG_BYTES) -> str:
    """A regular file of at most `limit` bytes, as UTF-8 text."""
    data = read_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UnreadableFile(f"{path} ({what}) is not UTF-8 text (byte {err.start}); it is damaged.") from None


def parse_json(text: str | bytes, where: str, allow_nan: bool = False) -> Any:
    """JSON from `text`; `where` names it in errors. NaN and Infinity (not JSON, though Python
    writes them) are refused unless `allow_nan`: a size of Infinity has no meaning."""

    def constant(name: str) -> float:
        if not allow_nan:
            raise ValueError(f"{name} is not a JSON number")
        return float(name)

    try:
        return json.loads(text, parse_constant=constant)
    except RecursionError:
        raise UnreadableFile(f"{where} is nested too deeply to be read (thousands of levels); it is not what it "
                             "claims to be.") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise UnreadableFile(f"{where} is not valid JSON ({err}).") from None


def read_json(path: Path, what: str, limit: int = CONFIG_BYTES, allow_nan: bool = False) -> Any:
    """A JSON file, within `limit` bytes."""
    return parse_json(read_text(path, what, limit), f"{path} ({what})", allow_nan)


def read_lines(path: Path, what: str, line_limit: int) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, the line's bytes with its line break) of a regular file, read one line at
    a time: a line longer than `line_limit` bytes (a binary file, a whole data set on one line) is
    refused naming its number, after reading no more than `line_limit` bytes of it."""
    path = Path(path)
    require_regular_file(path, what)
    try:
        with open(path, "rb") as handle:
            for number in itertools.count(1):
                line = handle.readline(line_limit + 1)
                if not line:
                    return
                if len(line) > line_limit and not (len(line) == line_limit + 1 and line.endswith(b"\n")):
                    raise UnreadableFile(f"{path}:{number} ({what}) is a line longer than {_size(line_limit)}, "
                                         "far more than one line of such a file holds; it is not what it claims to "
                                         "be (a binary file, or a whole data set on one line).")
                yield number, line
    except OSError as err:
        raise UnreadableFile(f"{path} ({what}) cannot be read ({err.strerror or type(err).__name__}).") from None


def parse_yaml(text: str, where: str, max_values: int = MAX_VALUES) -> Any:
    """YAML (the safe subset: plain data, no objects) whose expanded size is at most `max_values`."""
    import yaml

    try:
        # libyaml's loader where PyYAML has it: the same safe subset, ~10x faster than the pure-Python one
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506
    except RecursionError:
        raise UnreadableFile(f"{where} is nested too deeply to be read; it is not what it claims to be.") from None
    except yaml.YAMLError as err:
        raise UnreadableFile(f"{where} is not readable YAML ({' '.join(str(err).split())[:200]}).") from None
    if expanded_size(data, max_values) > max_values:
        raise UnreadableFile(f"{where} expands to more than {max_values:,} values (YAML aliases that repeat blocks "
                             "of blocks); no config is that large, so it is not what it claims to be.")
    return data


def read_yaml(path: Path, what: str, limit: int = CONFIG_BYTES, max_values: int = MAX_VALUES) -> Any:
    """A YAML file, within `limit` bytes and `max_values` values once its aliases are expanded."""
    return parse_yaml(read_text(path, what, limit), f"{path} ({what})", max_values)


def expanded_size(data: Any, limit: int) -> int:
    """How many values `data` holds with every shared reference counted each time it appears (what
    a copy or a conversion would build), counting no further than just past `limit`."""
    count, stack = 0, [data]
    while stack and count <= limit:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return count


def _size(n: int) -> str:
    return f"{n / MB:,.0f} MB" if n >= MB else f"{n:,} bytes"
