"""Per-file facts that tell text from degenerate data: byte entropy, the most common byte's share,
control bytes and where the NULs fall, replacement characters. Prepare records the files that look
degenerate in the prepared data's meta; the pre-flight check warns about them (and samples the
files itself when nothing is prepared yet).

A file of NUL bytes, of whitespace only, of undecodable bytes, a binary file (an archive, an image,
a program) or UTF-16/32 text without a byte-order mark trains "successfully": nothing in the run
looks wrong, and for near-constant data the loss to beat, its unigram entropy, is about 0.
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
# Control bytes text does not use (_CONTROL) above this share of a file: binary data. Text has none:
# 0 in each of ~26,000 files measured (Python and C sources, JSON, CSV, HTML, manual pages in 14
# languages, Chinese/Japanese/Korean text). Uniform binary bytes are 27/256 = 10.5% of them (archives
# and images measured 10-21%, programs 35%, UTF-16/32 text without a mark 36-75%): a file a twentieth
# binary reaches 0.5%, while a stray control byte in text (a DOS end-of-file mark) stays far below.
CONTROL_SHARE = 0.005
# Characters that are U+FFFD replacements above this share: bytes that are not UTF-8 text. Text in a
# Latin script saved in an 8-bit encoding (Latin-1, cp1250, cp1254, cp1257) loses its accented
# letters only: 2-10% of the characters in ~1 MB of translated prose per language (Czech and
# Hungarian the most; Czech and Icelandic prose 9-11%). Text in another script loses most letters:
# 28% (Hebrew messages, many ASCII placeholders) to 70% (Cyrillic, Greek); Chinese in GBK 35-53%;
# random bytes 44%, bytes 0x80-0xFF alone 80%.
REPLACEMENT_SHARE = 0.2
# Where a file's NULs fall tells UTF-16/32 text without a byte-order mark: a character's high bytes
# are NUL for ASCII, its low byte only for the rare character U+xx00; in binary data every offset
# gets its share. At most this share of the NULs on the "wrong" offsets still reads as that encoding.
STRAY_NUL_SHARE = 0.05
# A file is judged when it is at least this big or 1% of the corpus: tiny files do not matter alone.
# Small files that are not text (binary, undecodable, unmarked UTF-16/32) are judged together: many
# together may be as big.
JUDGED_BYTES = 2**20
# At most this many files are listed in the meta (the worst first); the count says how many in all.
LISTED_FILES = 20
# Before data is prepared the check reads the start of the biggest files only: it must stay quick.
SAMPLE_BYTES = 2**20
SAMPLED_FILES = 64

_REPLACEMENT = "\ufffd".encode()
_WHITESPACE = np.zeros(256, dtype=bool)
_WHITESPACE[list(b" \t\n\r\x0b\x0c")] = True
# C0 controls and DEL, less the ones text does hold: whitespace, backspace (overstrike in formatted
# manual pages) and escape (colours in terminal logs).
_CONTROL = np.zeros(256, dtype=bool)
_CONTROL[[*range(0x20), 0x7F]] = True
_CONTROL[list(b"\t\n\x0b\x0c\r\x08\x1b")] = False
_CONTINUATION = slice(0x80, 0xC0)  # UTF-8 continuation bytes: not characters of their own
_BATCH_BYTES = 2**20  # pieces are counted in batches: a JSON-lines file has millions of tiny documents
# UTF-16/32 without a mark: the offsets (mod 4) where its NULs never fall, and iconv's name for it.
_UNMARKED = {"UTF-16 LE": ((0, 2), "UTF-16LE"), "UTF-16 BE": ((1, 3), "UTF-16BE"),
             "UTF-32 LE": ((0,), "UTF-32LE"), "UTF-32 BE": ((3,), "UTF-32BE")}


class TextStats:
    """Byte counts, characters and replacement characters of one file, fed piece by piece in order."""

    def __init__(self) -> None:
        self.counts = np.zeros(256, dtype=np.int64)
        self.nuls_at = np.zeros(4, dtype=np.int64)  # NUL bytes by their offset in the file, mod 4
        self.characters = 0
        self.replacements = 0
        self._offset = 0
        self._pending: list[bytes] = []
        self._pending_bytes = 0

    def add(self, piece: bytes, valid_utf8: bool) -> None:
        """A piece of the file; `valid_utf8` False: its bad bytes become U+FFFD when it is decoded."""
        if not valid_utf8:
            self._count_pending()  # first: NULs are placed by their offset, so pieces count in order
            text = piece.decode("utf-8", errors="replace")
            self.characters += len(text)
            self.replacements += text.count("\ufffd")
            self._count_bytes(piece)
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
        counts = self._count_bytes(joined)
        self.characters += len(joined) - int(counts[_CONTINUATION].sum())
        self.replacements += joined.count(_REPLACEMENT)

    def _count_bytes(self, data: bytes) -> np.ndarray:
        """Add `data`'s byte counts and NUL offsets; return its byte counts."""
        values = np.frombuffer(data, dtype=np.uint8)
        counts = np.bincount(values, minlength=256)
        self.counts += counts
        if counts[0]:
            self.nuls_at += np.bincount((np.flatnonzero(values == 0) + self._offset) % 4, minlength=4)
        self._offset += len(data)
        return counts

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
            "dominant_is_control": bool(_CONTROL[dominant]),
            "whitespace_only": bool(total) and not self.counts[~_WHITESPACE].any(),
            "control_share": round(int(self.counts[_CONTROL].sum()) / max(1, total), 4),
            "nul_share": round(int(self.counts[0]) / max(1, total), 4),
            "unmarked_encoding": unmarked_encoding(self.nuls_at, total),
            "characters": self.characters,
            "replacements": self.replacements,
            "replacement_share": round(self.replacements / max(1, self.characters), 4),
        }


def unmarked_encoding(nuls_at: np.ndarray, total: int) -> str | None:
    """"UTF-16 LE" (BE, UTF-32 LE, BE) when a file's NULs, counted by offset mod 4, fall where that
    encoding puts them and almost never elsewhere; None for any other file. UTF-32 puts at least
    two NULs in every four bytes of text (a character above U+FFFF is rare), UTF-16 LE none at even
    offsets, BE none at odd ones. Too few NULs to tell (fewer than 16): None."""
    nuls = int(nuls_at.sum())
    if nuls < 16:
        return None
    for encoding, (never, _) in _UNMARKED.items():
        if encoding.startswith("UTF-32") and nuls < 0.4 * total:
            continue
        if sum(int(nuls_at[i]) for i in never) <= STRAY_NUL_SHARE * nuls:
            return encoding
    return None


def byte_name(value: int) -> str:
    """A byte as a reader knows it: NUL, space, line break, 'a', byte 0xFF."""
    names = {0: "NUL (byte 0)", 0x20: "space", 0x0A: "line break", 0x0D: "carriage return", 0x09: "tab"}
    if value in names:
        return names[value]
    return repr(chr(value)) if 0x20 < value < 0x7F else f"byte 0x{value:02X}"


def _share(value: float) -> str:
    """A share as people read it: 1.4%, 44%."""
    return f"{value:.1%}" if value < 0.1 else f"{value:.0%}"


def _named_encoding(facts: dict) -> str | None:
    """The UTF-16/32 encoding that explains a file's control bytes (its NULs), if one does."""
    encoding = facts.get("unmarked_encoding")
    return encoding if encoding and facts.get("control_share", 0) > CONTROL_SHARE else None


def not_text(facts: dict) -> list[str]:
    """Why a file is not text at all (binary data, another encoding), in words; [] for text. Unlike
    the byte distribution, these need no big sample: text has no control bytes and no U+FFFD."""
    controls, replaced = facts.get("control_share", 0), facts.get("replacement_share", 0)
    if encoding := _named_encoding(facts):
        return [f"{encoding} text without a byte-order mark? ({_share(facts['nul_share'])} of its bytes are NUL where "
                f"{encoding} has them: convert it with iconv -f {_UNMARKED[encoding][1]} -t UTF-8)"]
    # One control byte repeated (a file of NULs) is named by its share instead: problems().
    if controls > CONTROL_SHARE and not (facts.get("dominant_is_control") and facts["dominant_share"] > DOMINANT_SHARE):
        undecodable = f" and {_share(replaced)} of its characters undecodable" if replaced > REPLACEMENT_SHARE else ""
        return [f"not text ({_share(controls)} of its bytes are control characters{undecodable}, as in binary data)"]
    if replaced > REPLACEMENT_SHARE:
        return [f"{_share(replaced)} of its characters are undecodable (U+FFFD replacement: binary data, or text in "
                "another encoding to convert with iconv -f ENCODING -t UTF-8)"]
    return []


def problems(facts: dict) -> list[str]:
    """What makes a file's text degenerate, in words; [] for ordinary text."""
    found = not_text(facts)
    if facts.get("whitespace_only"):
        found.append("only whitespace")
    elif (facts.get("dominant_share", 0) > DOMINANT_SHARE
          and not (_named_encoding(facts) and facts["dominant_is_control"])):
        found.append(f"{_share(facts['dominant_share'])} of its bytes are {facts['dominant']}")
    if facts.get("entropy_nats", math.inf) < LOW_ENTROPY_NATS:
        found.append(f"entropy {facts['entropy_nats']:.2f} nats/byte")
    return found


def degenerate_files(all_facts: Iterable[dict]) -> tuple[list[dict], int]:
    """The degenerate files that matter (the biggest LISTED_FILES), and how many there are in all.
    A file matters when it is big enough (JUDGED_BYTES or 1% of the corpus); small files that are
    not text matter when together they are as big (a folder of many small binary files)."""
    all_facts = [f for f in all_facts if f["bytes"]]
    judged = min(JUDGED_BYTES, 0.01 * sum(f["bytes"] for f in all_facts))
    bad = [f for f in all_facts if f["bytes"] >= judged and problems(f)]
    small = [f for f in all_facts if f["bytes"] < judged and not_text(f)]
    if sum(f["bytes"] for f in small) >= judged:
        bad += small
    bad.sort(key=lambda f: -f["bytes"])
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
