"""What is not text is named before it trains; text in any script stays silent.

Binary files (random bytes, archives, images, a compiled library), UTF-16/32 text without a
byte-order mark, text in a legacy encoding that UTF-8 cannot read, one repeated byte: the
data-content check warns, naming the file and what it measured. Text in any script, code, CSV,
emoji, terminal logs and Latin-1 files with a few accented letters pass. Base64 is printable
text: it passes (deliberately; its loss to beat is ~4.2 nats/byte, not 0, so the run shows it).
"""

from __future__ import annotations

import base64
import gzip
import io
import itertools
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from llmtrain.config.schema import DataConfig, DataSource, TokenizerKind
from llmtrain.core.findings import Status
from llmtrain.data import quality
from llmtrain.data.prepare import prepare_data
from llmtrain.preflight.check import run_check

from ..conftest import TINY_CORPUS, run_cli, tiny_config

ENGLISH = TINY_CORPUS.read_text(encoding="utf-8")[:20_000]
RUSSIAN = ("Старый рыбак каждое утро выходил в море, а вечером возвращался с пустыми сетями. "
           "Соседи смеялись над ним, но мальчик верил, что удача ещё придёт.\n") * 80
CHINESE = "老人每天早上出海，晚上空手而归。邻居们都笑他，但是那个男孩相信好运总会到来。\n" * 120
JAPANESE = "老人は毎朝海へ出て、夕方には何も持たずに帰ってきた。近所の人は笑ったが、少年は信じていた。\n" * 100
KOREAN = "노인은 매일 아침 바다에 나갔다가 저녁이면 빈손으로 돌아왔다. 이웃들은 웃었지만 소년은 믿었다.\n" * 100
ARABIC = "كان الصياد العجوز يخرج إلى البحر كل صباح ويعود في المساء بشباك فارغة، لكن الصبي ظل يؤمن به.\n" * 100
HINDI = "बूढ़ा मछुआरा हर सुबह समुद्र में जाता और शाम को खाली जाल लेकर लौटता, पर लड़का उस पर विश्वास करता था।\n" * 80
EMOJI = "great run today 🏃‍♀️💨 new record!! 🎉🎉 then coffee ☕ with Zoë at the café 😀👍🏽 #mondays 🔥\n" * 150
GERMAN = "Über die Brücke gingen Jürgen und Käthe, während draußen der Föhn wehte und die Bäume rauschten.\n" * 100
FRENCH = "L'été dernier, à la fête du village, Hélène a goûté une crème brûlée près de l'église.\n" * 100
CZECH = ("Když jsem byl malý, trávil jsem každé léto u babičky na venkově. Ráno jsme chodili do lesa na houby "
         "a odpoledne jsem pomáhal dědovi na zahradě.\n") * 100
ICELANDIC = ("Þegar ég var lítill fórum við á hverju sumri í sveitina til ömmu og afa, þar sem ég hjálpaði til "
             "við heyskapinn.\n") * 100


def judged(tmp_path: Path, name: str, data: bytes) -> list[str]:
    """The data-content problems of a file holding `data`, read as the check reads a corpus that is
    not prepared yet (a byte-order mark decoded); [] when it passes."""
    path = tmp_path / name
    path.write_bytes(data)
    listed, _ = quality.sample_degenerate_files([(name, path)])
    return quality.problems(listed[0]) if listed else []


def png_bytes() -> bytes:
    import matplotlib.image

    buffer = io.BytesIO()
    matplotlib.image.imsave(buffer, np.random.default_rng(1).random((64, 64, 3)), format="png")
    return buffer.getvalue()


def zip_bytes() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("corpus.txt", ENGLISH)
    return buffer.getvalue()


def compiled_library() -> bytes:
    folder = Path(np.__file__).parent
    return next(p for p in folder.rglob("_multiarray_umath*") if p.suffix in (".so", ".pyd")).read_bytes()[:300_000]


RANDOM = np.random.default_rng(0).integers(0, 256, 40_000, dtype=np.uint8).tobytes()
# name -> (the file's bytes, what the warning says)
DEGENERATE = {
    "random bytes": (RANDOM, "not text"),
    "random high bytes": (np.random.default_rng(0).integers(0x80, 0x100, 40_000, dtype=np.uint8).tobytes(),
                          "undecodable"),
    "gzip": (lambda: gzip.compress(ENGLISH.encode()), "not text"),
    "zip": (zip_bytes, "not text"),
    "png": (png_bytes, "not text"),
    "compiled library": (compiled_library, "not text"),
    "mostly text, binary tail": (ENGLISH.encode() + RANDOM[:5_000], "not text"),
    "UTF-16 LE": (ENGLISH.encode("utf-16-le"), "UTF-16 LE text without a byte-order mark"),
    "UTF-16 BE": (ENGLISH.encode("utf-16-be"), "UTF-16 BE text without a byte-order mark"),
    "UTF-32 LE": (ENGLISH.encode("utf-32-le"), "UTF-32 LE text without a byte-order mark"),
    "UTF-32 BE": (ENGLISH.encode("utf-32-be"), "UTF-32 BE text without a byte-order mark"),
    "Russian UTF-16 LE": (RUSSIAN.encode("utf-16-le"), "iconv -f UTF-16LE -t UTF-8"),
    "Chinese UTF-16 BE": (CHINESE.encode("utf-16-be"), "iconv -f UTF-16BE -t UTF-8"),
    "Japanese UTF-32 LE": (JAPANESE.encode("utf-32-le"), "iconv -f UTF-32LE -t UTF-8"),
    "Russian cp1251": (RUSSIAN.encode("cp1251"), "undecodable"),
    "Chinese GBK": (CHINESE.encode("gbk"), "undecodable"),
    "all NUL": (b"\0" * 20_000, "100% of its bytes are NUL (byte 0)"),
    "one control byte": (b"\x01" * 20_000, "100% of its bytes are byte 0x01"),
    "one high byte": (b"\xff" * 20_000, "undecodable"),
    "one letter": (b"a" * 20_000, "100% of its bytes are 'a'"),
}


@pytest.mark.parametrize("name", sorted(DEGENERATE))
def test_what_is_not_text_is_named(tmp_path: Path, name: str) -> None:
    data, said = DEGENERATE[name]
    found = judged(tmp_path, "file.txt", data() if callable(data) else data)
    assert any(said in problem for problem in found), found


def csv_numbers() -> str:
    rows = np.random.default_rng(2).integers(0, 10_000, (2_000, 6))
    return "id,a,b,c,d,e\n" + "".join(",".join(map(str, row)) + "\n" for row in rows)


TEXT = {
    "English": ENGLISH.encode(),
    "Russian": RUSSIAN.encode(),
    "Chinese": CHINESE.encode(),
    "Japanese": JAPANESE.encode(),
    "Korean": KOREAN.encode(),
    "Arabic": ARABIC.encode(),
    "Hindi": HINDI.encode(),
    "emoji": EMOJI.encode(),
    "Python source": Path(quality.__file__).read_bytes(),
    "CSV": csv_numbers().encode(),
    "JSON": json.dumps([{"id": i, "name": f"item {i}", "tags": ["a", "b"], "price": i * 1.5} for i in range(400)],
                       indent=2).encode(),
    "terminal log": "".join(f"\x1b[32mINFO\x1b[0m step {i}: loss \x1b[1m{3 - i / 400:.3f}\x1b[0m\r\n"
                            for i in range(800)).encode(),
    "tabs, CRLF, form feeds": ("a\tb\tc\r\n" * 500 + "\f\n" + ENGLISH[:5000]).encode(),
    "German in Latin-1": GERMAN.encode("latin-1"),
    "French in Latin-1": FRENCH.encode("latin-1"),
    "Czech in cp1250": CZECH.encode("cp1250"),  # Czech and Icelandic: the most accented letters measured
    "Icelandic in Latin-1": ICELANDIC.encode("latin-1"),
    "UTF-16 LE with its mark": b"\xff\xfe" + RUSSIAN.encode("utf-16-le"),
    "base64": base64.encodebytes(RANDOM),
}


@pytest.mark.parametrize("name", sorted(TEXT))
def test_text_in_any_script_passes(tmp_path: Path, name: str) -> None:
    assert judged(tmp_path, "file.txt", TEXT[name]) == []


def test_nuls_are_placed_by_their_offset_across_pieces_of_any_length() -> None:
    """A file arrives in pieces of any length, valid UTF-8 ones batched and invalid ones counted at
    once: the NULs' offsets still count from the file's start."""
    data = CHINESE.encode("utf-16-le")  # its high bytes (0x4E-0x9F, 0xFF) make some pieces invalid UTF-8
    stats, ok, start = quality.TextStats(), True, 0
    for size in itertools.cycle((1, 2, 3, 1001, 7, 4096, 5)):
        piece, start = data[start:start + size], start + size
        try:
            piece.decode("utf-8")
        except UnicodeDecodeError:
            ok = False
        stats.add(piece, ok)
        if start >= len(data):
            break
    assert not ok, "some pieces were invalid UTF-8"
    assert stats.facts("zh.txt")["unmarked_encoding"] == "UTF-16 LE"


def test_many_small_binary_files_are_judged_together(tmp_path: Path) -> None:
    """Each under 1% of the corpus, together 25% of it: named. Small text files (short lines,
    a blank one, a line in Latin-1) are not."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "book.txt").write_text(ENGLISH * 3)
    rng = np.random.default_rng(3)
    for i in range(200):
        (folder / f"blob{i:03}.txt").write_bytes(rng.integers(0, 256, 100, dtype=np.uint8).tobytes())
        (folder / f"note{i:03}.txt").write_bytes(["ok!\n", "\n", "Le café est très bon.\n"][i % 3].encode("latin-1"))
    cfg = DataConfig(source=DataSource.text, path=str(folder), tokenizer=TokenizerKind.byte,
                     cache_dir=str(tmp_path / "cache"))
    meta = prepare_data(cfg, log=lambda _: None).meta
    assert meta["degenerate_file_count"] == 200
    assert all(f["file"].startswith("blob") for f in meta["degenerate_files"])
    assert len(meta["degenerate_files"]) == quality.LISTED_FILES


def test_the_two_first_reported_files_warn_before_and_after_preparing(tmp_path: Path) -> None:
    """Random bytes (44% U+FFFD) and UTF-16 LE text without a mark (50% NUL): the check names both,
    from a sample before the data is prepared and from the prepared data's facts after."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "book.txt").write_text(ENGLISH)
    (folder / "blob.txt").write_bytes(RANDOM)
    (folder / "notes.txt").write_bytes(ENGLISH.encode("utf-16-le"))
    cfg = tiny_config(tmp_path / "run", **{"data.path": str(folder)})
    before = run_check(cfg, measure_compute=False).row("data content")
    data = prepare_data(cfg.data, log=lambda _: None)
    after = run_check(cfg, measure_compute=False, data_meta=data.meta).row("data content")
    for row in (before, after):
        assert row.status is Status.WARN
        assert "blob.txt (40,000 bytes): not text (10% of its bytes are control characters" in row.seen
        assert "notes.txt" in row.seen and "UTF-16 LE text without a byte-order mark" in row.seen
        assert "book.txt" not in row.seen


def test_prepare_names_the_files_the_check_will_warn_about(tmp_path: Path) -> None:
    (tmp_path / "blob.txt").write_bytes(RANDOM)
    proc = run_cli("prepare", "data=text", f"data.path={tmp_path / 'blob.txt'}", cwd=tmp_path, columns=400)
    assert proc.returncode == 0, proc.stderr
    assert "warn data content: blob.txt (40,000 bytes): not text" in proc.stdout
    assert "remove or replace the named file(s)" in proc.stdout
