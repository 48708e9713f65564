"""Per-file facts that tell text from degenerate data: byte entropy, the most common byte's share,
replacement characters. Prepare records the files that look degenerate in the prepared data's meta;
the pre-flight check warns about them (and samples the files itself when nothing is prepared yet).

A file of NUL bytes, of whitespace only, or of undecodable bytes trains "successfully": its
unigram entropy, the loss to beat, is about 0, so nothing in the run looks wrong.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np

# Below this entropy (nats per byte, or per token for the whole corpus) the text is nearly constant;
# English text has ~3, code ~2.6-3.5 (the stdlib's lowest file: 2.6).
LOW_ENTROPY_NATS = 0.5
# One byte (or token) above this share of the data: the stdlib's highest is 42% (indentation spaces).
DOMINANT_SHARE = 0.5
# "Mostly replacement characters": undecodable bytes, binary data or a wrong encoding.
REPLACEMENT_SHARE = 0.5
# A file is judged when it is at least this big or 1% of the corpus: tiny files do not matter.
JUDGED_BYTES = 2**20
# At most this many files are listed in the meta (the worst first); the count says how many in all.
LISTED_FILES = 20
# Before data is prepared the check reads the start of the biggest files only: it must stay quick.
SAMPLE_BYTES = 2**20
SAMPLED_FILES = 64

_REPLACEMENT = "\ufffd".encode()
_WHITESPACE = np.zeros(256, dtype=bool)
_WHITESPACE[list(b" \t\n\r\x0b\x0c")] = True
_CONTINUATION = slice(0x80, 0xC0)  # UTF-8 continuation bytes: not characters of their own
_BATCH_BYTES = 2**20  # pieces are counted in batches: a JSON-lines file has millions of tiny documents


class TextStats:
    """Byte counts, characters and replacement characters of one file, fed piece by piece."""

    def __init__(self) -> None:
        self.counts = np.zeros(256, dtype=np.int64)
        self.characters = 0
        self.replacements = 0
        self._pending: list[bytes] = []
        self._pending_bytes = 0

    def add(self, piece: bytes, valid_utf8: bool) -> None:
        """A piece of the file; `valid_utf8` False: its bad bytes become U+FFFD when it is decoded."""
        if not valid_utf8:
            text = piece.decode("utf-8", errors="replace")
            self.characters += len(text)
            self.replacements += text.count("\ufffd")
            self.counts += np.bincount(np.frombuffer(piece, dtype=np.uint8), minlength=256)
            return
        self._pending.append(piece)
        self._pending_bytes += len(piece)
        if self._pending_bytes >= _BATCH_BYTES:
            self._count_pending()

    def _count_pending(self) -> None:
        if not self._pending:
            return
        joined = b"".join(self._pending)
        self._pending, self._pending_bytes = [], 0
        counts = np.bincount(np.frombuffer(joined, dtype=np.uint8), minlength=256)
        self.counts += counts
        self.characters += len(joined) - int(counts[_CONTINUATION].sum())
        self.replacements += joined.count(_REPLACEMENT)

    def facts(self, name: str) -> dict:
        """The file's facts as JSON-able values (what the check phrases)."""
        self._count_pending()
        total = int(self.counts.sum())
        p = self.counts[self.counts > 0] / max(1, total)
        dominant = int(self.counts.argmax())
        return {
            "file": name,
            "bytes": total,
            "entropy_nats": round(float(-(p * np.log(p)).sum()), 4) + 0.0,  # never -0.0
            "dominant": byte_name(dominant),
            "dominant_share": round(float(self.counts[dominant]) / max(1, total), 4),
            "whitespace_only": bool(total) and not self.counts[~_WHITESPACE].any(),
            "characters": self.characters,
            "replacements": self.replacements,
            "replacement_share": round(self.replacements / max(1, self.characters), 4),
        }


def byte_name(value: int) -> str:
    """A byte as a reader knows it: NUL, space, line break, 'a', byte 0xFF."""
    names = {0: "NUL (byte 0)", 0x20: "space", 0x0A: "line break", 0x0D: "carriage return", 0x09: "tab"}
    if value in names:
        return names[value]
    return repr(chr(value)) if 0x20 < value < 0x7F else f"byte 0x{value:02X}"


def problems(facts: dict) -> list[str]:
    """What makes a file's text degenerate, in words; [] for ordinary text."""
    found = []
    if facts.get("replacement_share", 0) > REPLACEMENT_SHARE:
        found.append(f"{facts['replacement_share']:.0%} of its characters are undecodable (U+FFFD replacement)")
    if facts.get("whitespace_only"):
        found.append("only whitespace")
    elif facts.get("dominant_share", 0) > DOMINANT_SHARE:
        found.append(f"{facts['dominant_share']:.0%} of its bytes are {facts['dominant']}")
    if facts.get("entropy_nats", math.inf) < LOW_ENTROPY_NATS:
        found.append(f"entropy {facts['entropy_nats']:.2f} nats/byte")
    return found


def degenerate_files(all_facts: Iterable[dict]) -> tuple[list[dict], int]:
    """The files big enough to matter whose text is degenerate (the biggest LISTED_FILES), and how
    many there are in all."""
    all_facts = list(all_facts)
    judged = min(JUDGED_BYTES, 0.01 * sum(f["bytes"] for f in all_facts))
    bad = sorted((f for f in all_facts if f["bytes"] >= judged and f["bytes"] and problems(f)),
                 key=lambda f: -f["bytes"])
    return bad[:LISTED_FILES], len(bad)


def describe(facts: dict) -> str:
    """`name (5,000 bytes): 100% of its bytes are NUL (byte 0), entropy 0.00 nats/byte`."""
    return f"{facts['file']} ({facts['bytes']:,} bytes): {', '.join(problems(facts))}"


def sample_degenerate_files(files: list[tuple[str, Path]]) -> tuple[list[dict], int]:
    """`degenerate_files` of text files not prepared yet, on the first SAMPLE_BYTES of each of the
    SAMPLED_FILES biggest (read as prepare reads them: UTF-16/32 with a byte-order mark decoded)."""
    from llmtrain.data.corpus import FilePieces

    biggest = sorted(files, key=lambda f: -f[1].stat().st_size)[:SAMPLED_FILES]
    facts = []
    for name, path in biggest:
        stats = TextStats()
        for piece in FilePieces(path, SAMPLE_BYTES):
            try:
                piece.decode("utf-8")
                stats.add(piece, True)
            except UnicodeDecodeError:
                stats.add(piece, False)
        facts.append(stats.facts(name))
    return degenerate_files(facts)
