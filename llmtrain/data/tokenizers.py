"""Tokenizers that travel with the prepared data (and into the run dir, for `sample`)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None  # the end-of-text token written after every document (None: an old char tokenizer)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self) -> list[bytes | None] | None: ...  # what each id decodes to (None: special)

    def to_dict(self) -> dict: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train, lossless.

    Byte 255 never occurs in UTF-8, so it serves as the end-of-text token without growing the
    vocabulary; decoding drops it (as Hugging Face tokenizers drop their special tokens)."""

    vocab_size = 256
    eos_id = 0xFF

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i != self.eos_id).decode("utf-8", errors="replace")

    def token_bytes(self) -> list[bytes | None]:
        """What each id decodes to (for `Utf8Guard`); None for end-of-text."""
        return [None if i == self.eos_id else bytes([i]) for i in range(self.vocab_size)]

    def to_dict(self) -> dict:
        return {"kind": "byte"}


class Utf8Guard:
    """Keeps generated tokens valid UTF-8 when they are decoded: `banned(size)` marks the ids that
    cannot come next, `advance(id)` takes the one that came. A byte-level model (byte tokens, or BPE
    tokens that are byte strings) can put a continuation byte between characters or start a new
    character inside one; decoding that gives U+FFFD. `token_bytes[i]` is what id i decodes to (None:
    a special token, e.g. end-of-text, allowed only between characters). The UTF-8 rules are RFC
    3629's: no overlong forms, no surrogates, nothing past U+10FFFF. The banned ids of each of the
    few states between and inside characters are computed once, when first met."""

    # The first continuation byte's range after each lead byte that restricts it.
    FIRST = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
    BETWEEN = (0, 0x80, 0xBF)  # (continuation bytes still to come, their first one's range)

    def __init__(self, token_bytes: list[bytes | None]) -> None:
        self.token_bytes = token_bytes
        self.state = self.BETWEEN
        self.pending = 0  # bytes of the unfinished character so far (0: between characters)
        self._banned: dict[tuple[int, int, int], np.ndarray] = {}

    @classmethod
    def step(cls, state: tuple[int, int, int], byte: int) -> tuple[int, int, int] | None:
        """The state after `byte`, or None when UTF-8 cannot have it there."""
        need, low, high = state
        if need:
            return (need - 1, 0x80, 0xBF) if low <= byte <= high else None
        if byte < 0x80:
            return state
        if 0xC2 <= byte <= 0xF4:
            return (1 if byte < 0xE0 else 2 if byte < 0xF0 else 3, *cls.FIRST.get(byte, (0x80, 0xBF)))
        return None

    def _after(self, state: tuple[int, int, int], data: bytes | None) -> tuple[int, int, int] | None:
        if data is None:  # a special token: only between characters
            return state if state[0] == 0 else None
        for byte in data:
            state = self.step(state, byte)
            if state is None:
                return None
        return state

    def banned(self, size: int) -> np.ndarray:
        """A bool array over `size` ids: True where the id may not come next (and past the tokenizer's ids)."""
        mask = self._banned.get(self.state)
        if mask is None:
            mask = np.array([self._after(self.state, data) is None for data in self.token_bytes], dtype=bool)
            self._banned[self.state] = mask
        return mask[:size] if len(mask) >= size else np.concatenate([mask, np.ones(size - len(mask), dtype=bool)])

    def advance(self, token: int) -> None:
        data = self.token_bytes[token] if token < len(self.token_bytes) else None
        state, pending = self.state, self.pending
        for byte in b"" if data is None else data:
            state = self.step(state, byte)
            if state is None:  # an id banned() did not allow: start over between characters
                state, pending = self.BETWEEN, 0
                break
            pending = 0 if state[0] == 0 else pending + 1
        self.state, self.pending = state, pending


def byte_level_token_bytes(inner) -> list[bytes | None] | None:
    """token id -> bytes of a `tokenizers` tokenizer whose tokens are byte-level strings (GPT-2's
    alphabet: a ByteLevel decoder), special tokens None; None for any other kind of tokenizer."""
    decoder = json.loads(inner.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or [] if isinstance(d, dict)}
    if "ByteLevel" not in kinds:
        return None
    alphabet = byte_level_chars()
    special = {token.content for token in inner.get_added_tokens_decoder().values() if token.special}
    out: list[bytes | None] = []
    for i in range(inner.get_vocab_size(with_added_tokens=True)):
        token = inner.id_to_token(i)
        if token is None or token in special or any(c not in alphabet for c in token):
            out.append(None)
        else:
            out.append(bytes(alphabet[c] for c in token))
    return out


class CharTokenizer:
    """One token per distinct character of the corpus (sorted), then one end-of-text token."""

    def __init__(self, chars: list[str], end_of_text: bool = True) -> None:
        self.chars = chars
        self.index = {c: i for i, c in enumerate(chars)}
        # Tokenizers saved before end-of-text existed load without it (their data has none).
        self.eos_id = len(chars) if end_of_text else None
        self.vocab_size = len(chars) + int(end_of_text)
        self._codepoints = np.array([ord(c) for c in chars], dtype=np.uint32)

    @classmethod
    def fit(cls, characters: set[str]) -> CharTokenizer:
        return cls(sorted(characters))

    def encode(self, text: str) -> list[int]:
        try:
            return [self.index[c] for c in text]
        except KeyError as err:
            known = "".join(self.chars[:40])
            raise ValueError(
                f"character {err.args[0]!r} is not in this char tokenizer's vocabulary "
                f"({len(self.chars)} characters, starting {known!r})"
            ) from None

    def encode_array(self, text: str) -> np.ndarray:
        """encode() vectorized (~50x faster): code points looked up in the sorted vocabulary."""
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = np.searchsorted(self._codepoints, points)
        unknown = (ids >= len(self.chars)) | (self._codepoints[np.minimum(ids, len(self.chars) - 1)] != points)
        if unknown.any():
            self.encode(chr(points[int(np.argmax(unknown))]))  # raises the readable error
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids if i != self.eos_id)

    def token_bytes(self) -> list[bytes | None]:
        return ([c.encode("utf-8", errors="surrogatepass") for c in self.chars]
                + ([None] if self.eos_id is not None else []))

    def to_dict(self) -> dict:
        return {"kind": "char", "chars": self.chars, "end_of_text": self.eos_id is not None}


class BPETokenizer:
    """Byte-level BPE trained on the corpus with Hugging Face `tokenizers` (Rust, parallel): any
    text encodes (the 256 bytes are in the alphabet), and decoding is lossless."""

    END_OF_TEXT = "<|endoftext|>"

    def __init__(self, inner) -> None:  # inner: tokenizers.Tokenizer
        self.inner = inner
        self.vocab_size = inner.get_vocab_size()
        self.eos_id = inner.token_to_id(self.END_OF_TEXT)

    @classmethod
    def fit(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        inner = HFTokenizer(models.BPE())
        inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        inner.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[cls.END_OF_TEXT], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        inner.train_from_iterator(texts, trainer=trainer)
        return cls(inner)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.inner.encode_batch(texts)]

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """Many texts at once, on all cores, as uint32 arrays. tiktoken's BPE (same pre-tokenizer
        regex, ranks in merge order) gives the same tokens ~3.5x faster than `tokenizers` (measured:
        16 vs 4.6 MB/s on 2 cores) and without a Python int per token, so it does the bulk encoding
        once it has agreed with `tokenizers` on a probe text."""
        fast = self._tiktoken()
        if fast is not None:
            return tiktoken_arrays(fast, texts)
        return [np.asarray(ids, dtype=np.uint32) for ids in self.encode_batch(texts)]

    def _tiktoken(self):
        if not hasattr(self, "_fast"):
            self._fast = None
            try:
                import tiktoken
            except ImportError:  # pragma: no cover - a core dependency; the slower path still works
                return None
            decode_char = byte_level_chars()
            ranks = {bytes(decode_char[c] for c in token): i for token, i in self.inner.get_vocab().items()
                     if token != self.END_OF_TEXT}
            fast = tiktoken.Encoding("llmtrain-bpe", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks,
                                     special_tokens={self.END_OF_TEXT: self.eos_id})
            if fast.encode_ordinary(_PROBE) == self.inner.encode(_PROBE).ids:
                self._fast = fast
        return self._fast

    def token_bytes(self) -> list[bytes | None] | None:
        return byte_level_token_bytes(self.inner)

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(list(ids))

    def to_dict(self) -> dict:
        return {"kind": "bpe", "tokenizer": json.loads(self.inner.to_str())}


class PretrainedTokenizer:
    """The tokenizer.json of a Hugging Face model folder (data.tokenizer=pretrained; model.init_from
    sets it), through the `tokenizers` library: the ids the folder's checkpoint was trained on.

    Text is encoded plainly (no BOS or template tokens: documents are separated by end-of-text, as
    for every llmtrain tokenizer); decoding drops special tokens. The end-of-text id comes from the
    folder's config.json (eos_token_id), else tokenizer_config.json (eos_token), else a special token
    of a well-known end-of-text name; a tokenizer with none is refused, since documents would run
    into each other."""

    # Names end-of-text goes by, tried in order when the folder's files name none.
    KNOWN_ENDS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")

    def __init__(self, inner, eos_id: int, bos_id: int | None, source: str, eos_origin: str = "") -> None:
        self.inner = inner  # tokenizers.Tokenizer
        self.vocab_size = inner.get_vocab_size(with_added_tokens=True)
        self.eos_id, self.bos_id, self.source = eos_id, bos_id, source
        self.eos_origin = eos_origin  # where the end-of-text id was found, for prepare's log

    @classmethod
    def from_folder(cls, location: str, key: str = "data.tokenizer_dir") -> PretrainedTokenizer:
        """The folder's tokenizer.json with its end-of-text and beginning-of-text ids; ConfigError
        names a missing or unreadable file, or a tokenizer without end-of-text."""
        from llmtrain.core.errors import ConfigError
        from llmtrain.core.hf_files import TOKENIZER

        path = _tokenizer_folder(location, key)
        file = path / TOKENIZER
        if not os.path.lexists(file):  # anything else there (a FIFO, a folder) is named by the reader
            raise ConfigError(f"{key}={location} has no {TOKENIZER}, so its token ids are unknown; the folder is "
                              "incomplete: copy the model's tokenizer.json into it (it comes with the model, e.g. "
                              "from `hf download NAME --local-dir FOLDER`).")
        inner = _read_tokenizer_json(file)
        bos, eos, origin = _special_ids(path, inner, key)
        if eos is None:
            eos, origin = _known_end(inner, cls.KNOWN_ENDS)
        if eos is None or not 0 <= eos < inner.get_vocab_size(with_added_tokens=True):
            found = f"an eos id {eos} outside its vocabulary" if eos is not None else "no end-of-text token"
            raise ConfigError(
                f"{key}={location}: {file} has {found} (config.json's eos_token_id, tokenizer_config.json's "
                f"eos_token, or a special token named {' or '.join(cls.KNOWN_ENDS[:2])}); llmtrain separates "
                "documents with it. Add \"eos_token\": \"TOKEN\" to tokenizer_config.json (or eos_token_id to "
                "config.json), naming the model's end-of-text token.")
        return cls(inner, eos, bos, str(location), origin)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets nobody here reads
        encode = getattr(self.inner, "encode_batch_fast", self.inner.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """Many texts at once, on all cores (tokenizers' Rust thread pool), as uint32 arrays."""
        return [np.asarray(ids, dtype=np.uint32) for ids in self.encode_batch(texts)]

    def token_bytes(self) -> list[bytes | None] | None:
        """Byte-level tokenizers' (GPT-2, SmolLM); None for others (SentencePiece pieces)."""
        return byte_level_token_bytes(self.inner)

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=True)

    def to_dict(self) -> dict:
        return {"kind": "pretrained", "tokenizer": json.loads(self.inner.to_str()), "eos_id": self.eos_id,
                "bos_id": self.bos_id, "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> PretrainedTokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_str(json.dumps(data["tokenizer"])), int(data["eos_id"]),
                   data.get("bos_id"), str(data.get("source", "")))


def _tokenizer_folder(location: str, key: str) -> Path:
    from llmtrain.core.hf_files import folder_path

    return folder_path(location, key)


def _read_tokenizer_json(file: Path):
    from tokenizers import Tokenizer as HFTokenizer

    from llmtrain.core.errors import ConfigError
    from llmtrain.core.readers import TOKENIZER_BYTES, read_text

    text = read_text(file, "a tokenizer", TOKENIZER_BYTES)  # a regular file of a tokenizer's size, UTF-8
    try:
        return HFTokenizer.from_str(text)
    except Exception as err:  # tokenizers raises a bare Exception for unreadable JSON or an unknown model
        raise ConfigError(f"{file} is not a tokenizer the `tokenizers` library can read ({str(err)[:200]}); the "
                          "folder is damaged: download or save it again.") from None


def _special_ids(path: Path, inner, key: str) -> tuple[int | None, int | None, str]:
    """(bos, eos, where eos was found): config.json's ids when it has them, else the token strings
    of tokenizer_config.json looked up in the tokenizer."""
    from llmtrain.core.hf_files import CONFIG, TOKENIZER_CONFIG, read_config, special_ids

    bos = eos = None
    if (path / CONFIG).is_file():
        # Any architecture's config.json names its special ids; the layout does not matter here.
        bos, eos = special_ids(path, read_config(path, key))
        if eos is not None:
            return bos, eos, CONFIG
    settings = path / TOKENIZER_CONFIG
    if os.path.lexists(settings):
        from llmtrain.core.readers import UnreadableFile, read_json

        try:
            data = read_json(settings, "the tokenizer's settings")
        except UnreadableFile:
            data = {}  # optional file; the well-known names are tried next
        data = data if isinstance(data, dict) else {}
        names = {k: v.get("content") if isinstance(v, dict) else v for k, v in data.items()
                 if k in ("bos_token", "eos_token")}
        if bos is None and isinstance(names.get("bos_token"), str):
            bos = inner.token_to_id(names["bos_token"])
        if isinstance(names.get("eos_token"), str) and (eos := inner.token_to_id(names["eos_token"])) is not None:
            return bos, eos, f"{TOKENIZER_CONFIG} ({names['eos_token']})"
    return bos, None, ""


def _known_end(inner, names: tuple[str, ...]) -> tuple[int | None, str]:
    """The id of the first special token with a well-known end-of-text name, if the tokenizer has one."""
    special = {t.content for t in inner.get_added_tokens_decoder().values() if t.special}
    for name in names:
        if name in special:
            return inner.token_to_id(name), f"its special token {name} (no eos named in the folder's files)"
    return None, ""


# The pre-tokenizer regex of GPT-2 and of tokenizers' ByteLevel (use_regex=True).
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_PROBE = "def f(x):\n    return x  # it's 42\n\n\tnaïve café – 数据 🙂  spaces   end\n"


def byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the
    other 68 are shifted to code points 256+ (so every token is printable text)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(shifted)}


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tiktoken_arrays(encoding, texts: list[str]) -> list[np.ndarray]:
    """Plain-text encoding (special-token text is ordinary text) straight into uint32 arrays, one
    thread per core: tiktoken releases the GIL while it encodes."""
    from concurrent.futures import ThreadPoolExecutor

    def one(text: str) -> np.ndarray:
        return encoding.encode_to_numpy(text, disallowed_special=())

    if len(texts) < 2:
        return [one(t) for t in texts]
    with ThreadPoolExecutor(max_workers=min(_cores(), len(texts))) as pool:
        return list(pool.map(one, texts))


class TiktokenTokenizer:
    """A fixed tiktoken BPE, e.g. GPT-2's (vocabulary 50257, <|endoftext|> = 50256). Saved whole
    (ranks, regex, special tokens) with the data, so `sample` needs neither network nor cache."""

    END_OF_TEXT = "<|endoftext|>"

    def __init__(self, name: str, ranks: dict[bytes, int], pat_str: str, special_tokens: dict[str, int]) -> None:
        import tiktoken

        self.name, self.ranks, self.pat_str, self.special_tokens = name, ranks, pat_str, special_tokens
        self.inner = tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=special_tokens)
        self.vocab_size = self.inner.n_vocab
        self.eos_id = special_tokens.get(self.END_OF_TEXT)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode_ordinary(text)

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return tiktoken_arrays(self.inner, texts)

    def token_bytes(self) -> list[bytes | None]:
        specials = set(self.special_tokens.values())
        return [None if i in specials else self.inner.decode_single_token_bytes(i) for i in range(self.vocab_size)]

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode([i for i in ids if i != self.eos_id], errors="replace")

    def to_dict(self) -> dict:
        ordered = sorted(self.ranks.items(), key=lambda item: item[1])
        return {"kind": "tiktoken", "name": self.name, "pat_str": self.pat_str, "special_tokens": self.special_tokens,
                "ranks": [[base64.b64encode(token).decode(), rank] for token, rank in ordered]}

    @classmethod
    def from_dict(cls, data: dict) -> TiktokenTokenizer:
        ranks = {base64.b64decode(token): rank for token, rank in data["ranks"]}
        return cls(data["name"], ranks, data["pat_str"], dict(data["special_tokens"]))


GPT2_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
GPT2_FILES = ("vocab.bpe", "encoder.json")
# The published files' SHA-256 (as tiktoken checks them after a download).
GPT2_SHA256 = ("1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
               "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783")


def gpt2_files(folder: str | None) -> list[Path]:
    """GPT-2's vocab.bpe and encoder.json on this machine: in `folder`, or (folder None) the copies
    tiktoken keeps in its cache after an online `tiktoken.get_encoding("gpt2")`. Nothing is
    downloaded. Raises FileNotFoundError saying what was searched."""
    if folder is not None:
        paths = [Path(folder).expanduser() / name for name in GPT2_FILES]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"data.gpt2_dir is '{folder}', which lacks {' and '.join(missing)}")
        return paths
    cache = _tiktoken_cache_dir()
    paths = [Path(cache) / hashlib.sha1((GPT2_URL + name).encode()).hexdigest() for name in GPT2_FILES]
    if not all(p.is_file() for p in paths):
        raise FileNotFoundError(f"they are not in tiktoken's cache ({cache}) and data.gpt2_dir is not set")
    return paths


def gpt2_tokenizer(paths: list[Path]) -> TiktokenTokenizer:
    """GPT-2's BPE from its vocab.bpe and encoder.json (ranks in merge order, <|endoftext|> last)."""
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    try:
        ranks = data_gym_to_mergeable_bpe_ranks(str(paths[0]), str(paths[1]))
    except (AssertionError, ValueError, KeyError, UnicodeDecodeError) as err:
        raise FileNotFoundError(f"{paths[0]} and {paths[1]} are not a matching GPT-2 vocab.bpe / encoder.json pair "
                                f"({type(err).__name__})") from None
    return TiktokenTokenizer("gpt2", ranks, GPT2_SPLIT_PATTERN, {TiktokenTokenizer.END_OF_TEXT: len(ranks)})


def _tiktoken_cache_dir() -> str:
    """Where tiktoken caches downloads (its own rule: TIKTOKEN_CACHE_DIR, DATA_GYM_CACHE_DIR, temp)."""
    import tempfile

    return os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), "data-gym-cache")


TOKENIZER_KINDS = ("byte", "char", "bpe", "tiktoken", "pretrained")


def tokenizer_from_dict(data: dict) -> Tokenizer:
    if data["kind"] == "byte":
        return ByteTokenizer()
    if data["kind"] == "char":
        return CharTokenizer(list(data["chars"]), bool(data.get("end_of_text", False)))
    if data["kind"] == "bpe":
        from tokenizers import Tokenizer as HFTokenizer

        return BPETokenizer(HFTokenizer.from_str(json.dumps(data["tokenizer"])))
    if data["kind"] == "tiktoken":
        return TiktokenTokenizer.from_dict(data)
    if data["kind"] == "pretrained":
        return PretrainedTokenizer.from_dict(data)
    raise ValueError(f"unknown tokenizer kind {data['kind']!r}; valid: {', '.join(TOKENIZER_KINDS)}")


def save_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    path.write_text(json.dumps(tokenizer.to_dict(), ensure_ascii=False))


def load_tokenizer(path: Path) -> Tokenizer:
    """A tokenizer.json that `save_tokenizer` wrote (a run's, an export's); UserError naming the file
    when it is not one (truncated, another program's, of an unknown kind)."""
    from llmtrain.core.errors import UserError
    from llmtrain.core.readers import TOKENIZER_BYTES, read_json

    data = read_json(path, "the run's tokenizer", TOKENIZER_BYTES)
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in TOKENIZER_KINDS:
        raise UserError(f"{path} is not a tokenizer llmtrain wrote: its kind is {kind!r}, not one of "
                        f"{', '.join(TOKENIZER_KINDS)}; the run directory is damaged.")
    try:
        return tokenizer_from_dict(data)
    except Exception as err:  # noqa: BLE001 - a missing field, a wrong type, the tokenizers library refusing its JSON
        raise UserError(f"{path} is not a readable {kind} tokenizer ({type(err).__name__}: {str(err)[:200]}); the "
                        "run directory is damaged.") from None
