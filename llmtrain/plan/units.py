"""The figures `llmtrain plan` reads off its command line: a device count and a memory size.

Only the standard library: the CLI checks these before it imports torch, so a bad value is refused
at once, in one paragraph."""

from __future__ import annotations

import re

from llmtrain.core.errors import UserError

# Binary units whichever way they are written: GPU makers' "GB" is 2^30 bytes (an 80GB A100 has
# 80 GiB, a 24GB card 24 GiB, a 141GB H200 140 GiB), as in nvidia-smi, `free -h` and torch's messages.
_UNITS = {
    "": None, "b": 1,
    **{unit: 2**10 for unit in ("k", "kb", "kib")},
    **{unit: 2**20 for unit in ("m", "mb", "mib")},
    **{unit: 2**30 for unit in ("g", "gb", "gib")},
    **{unit: 2**40 for unit in ("t", "tb", "tib")},
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
MEMORY_FORMS = ("a number with its unit, e.g. 80GB, 80GiB or 24G (each read as 2^30 bytes, as GPU makers count: "
                "an 80GB card has 80 GiB); MB, MiB, TB and TiB work too")
MAX_DEVICES = 1_000_000


def parse_memory(text: str, option: str = "--device-memory") -> float:
    """Bytes of a size like 80GB, 80GiB, 24G, 512MiB (all binary); UserError naming the value otherwise."""
    match = _SIZE.match(text)
    unit = _UNITS.get(match.group(2).lower(), 0) if match else 0
    if match and unit is None:
        raise UserError(f"{option} is '{text}', a number without its unit; give {MEMORY_FORMS}.")
    if not match or not unit:
        raise UserError(f"{option} is '{text}', which is no memory size; give {MEMORY_FORMS}.")
    size = float(match.group(1)) * unit
    if size < 2**20:
        raise UserError(f"{option} is '{text}', less than a MiB: no model fits; give {MEMORY_FORMS}.")
    return size


def parse_devices(text: str, option: str = "--devices") -> int:
    """A device count: a whole number from 1 to MAX_DEVICES; UserError naming the value otherwise."""
    try:
        n = int(text.strip().replace("_", ""))
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_DEVICES:
        raise UserError(f"{option} is '{text}'; give the number of devices (GPUs, or processes on a CPU) as a "
                        f"whole number from 1 to {MAX_DEVICES:,}, e.g. {option} 8.")
    return n
