"""Where prepared data lives, and whether it is there and up to date.

The cache folder is keyed by everything that changes the tokens (source, path, tokenizer, split,
byte cap, ...: `location`). Inside, `meta.json` records a cheap fingerprint (names, sizes, mtimes)
and a content hash; `cached_meta` and `cached_data` give what is prepared and up to date without
building anything (prepare.py builds). `PreparedData` is a prepared folder: its token files,
tokenizer and metadata.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmtrain.config.schema import DataConfig, DataSource, DecodeErrors, TokenizerKind
from llmtrain.core.cache_home import cache_home
from llmtrain.core.files import TOKENIZER  # the same file name in the data cache as in a run dir
from llmtrain.core.readers import UnreadableFile, read_json
from llmtrain.data.chat_template import TEMPLATE_FILE, ChatTemplate, checked, find_template
from llmtrain.data.corpus import (
    SourceFile,
    fingerprint,
    input_files,
    load_hf_dataset,
    marked_encoding,
    stdlib_files,
    stdlib_root,
)
from llmtrain.data.tokenizers import GPT2_URL, PretrainedTokenizer, Tokenizer, gpt2_files, load_tokenizer

# 2: end-of-text after every document for every tokenizer (byte 255; char: one more id).
FORMAT_VERSION = 2


@dataclass
class PreparedData:
    directory: Path
    meta: dict
    built: bool = False  # built by this call, not reused from the cache (prepare's summary says which)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def unigram_entropy(self) -> float:
        """Entropy of the train split's token frequencies, in nats: the loss of a model that
        ignores context. A model that learned anything beats it."""
        return float(self.meta["unigram_entropy_nats"])

    def tokens(self, split: str) -> np.ndarray:
        if self.meta[f"{split}_tokens"] == 0:  # np.memmap cannot map an empty file
            return np.zeros(0, dtype=np.dtype(self.meta["dtype"]))
        return np.memmap(self.directory / f"{split}.bin", dtype=np.dtype(self.meta["dtype"]), mode="r")

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.directory / TOKENIZER)

    def loss_mask(self, split: str) -> np.ndarray:
        """Instruction data: 1 where a token is a training target (response), 0 for prompt tokens."""
        return np.memmap(self.directory / f"{split}.mask.bin", dtype=np.uint8, mode="r")

    def offsets(self, split: str) -> np.ndarray:
        """Instruction data: where each example starts in the token file (and, last, where the last ends)."""
        return np.load(self.directory / f"{split}.idx.npy")


def cache_root(cfg: DataConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    return cache_home()


def source_files(cfg: DataConfig) -> list[SourceFile]:
    """The input files (none for data=hf: its dataset is not files of ours)."""
    if cfg.source is DataSource.python_stdlib:
        return stdlib_files()
    if cfg.source is DataSource.hf:
        return []
    assert cfg.path is not None
    return input_files(cfg.path, cfg.source.value)


def location(cfg: DataConfig) -> tuple[list[SourceFile], Path]:
    """The source files and the cache folder of the prepared data for `cfg`."""
    files = source_files(cfg)
    identity = {
        "format": FORMAT_VERSION,
        "source": cfg.source.value,
        "files": [str(f.path) for f in files] if cfg.source is not DataSource.python_stdlib else str(stdlib_root()),
        "tokenizer": cfg.tokenizer.value,
        "val_fraction": cfg.val_fraction,
        "max_bytes": cfg.max_bytes,
    }
    # Keys that only some sources or tokenizers read enter only where they apply.
    if cfg.source in (DataSource.jsonl, DataSource.hf):
        identity["text_field"] = cfg.text_field
    if cfg.source is DataSource.hf:
        assert cfg.hf_name is not None
        local = Path(cfg.hf_name).expanduser()
        identity["hf"] = [str(local.resolve()) if local.is_dir() else cfg.hf_name, cfg.hf_config, cfg.hf_split,
                          str(Path(cfg.path).expanduser().resolve()) if cfg.path else None]
    if cfg.source is DataSource.instruct:
        identity["fields"] = [cfg.prompt_field, cfg.response_field, cfg.messages_field]
    if cfg.tokenizer is TokenizerKind.bpe:
        identity["bpe_vocab_size"] = cfg.bpe_vocab_size
        identity["bpe_sample_bytes"] = cfg.bpe_sample_bytes
    if cfg.decode_errors is not DecodeErrors.replace:
        identity["decode_errors"] = cfg.decode_errors.value
    if cfg.tokenizer is TokenizerKind.gpt2:
        identity["gpt2_files_sha256"] = [hashlib.sha256(p.read_bytes()).hexdigest() for p in gpt2_files_of(cfg)]
    if cfg.tokenizer is TokenizerKind.pretrained:
        # The tokens are the folder's: its tokenizer.json's content and end-of-text id, not its path.
        identity["pretrained"] = pretrained_identity(cfg)
        if template := chat_template(cfg):  # a changed template (or its tokens) renders other text
            identity["chat_template_sha256"] = template.sha256
    if decoded := decoded_files(cfg, files):  # a cache built when such a file was read as UTF-8 is not reused
        identity["decoded_from"] = decoded
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return files, cache_root(cfg) / "data" / f"{cfg.source.value}-{cfg.tokenizer.value}-{key}"


def decoded_files(cfg: DataConfig, files: list[SourceFile]) -> dict[str, str]:
    """The text files read as UTF-16/32 (they start with its byte-order mark): name -> encoding."""
    if cfg.source is not DataSource.text:
        return {}
    return {f.name: marked[1] for f in files if (marked := marked_encoding(f.path))}


def gpt2_files_of(cfg: DataConfig) -> list[Path]:
    from llmtrain.core.errors import ConfigError

    try:
        return gpt2_files(cfg.gpt2_dir)
    except FileNotFoundError as err:
        raise ConfigError(
            f"data.tokenizer=gpt2 needs GPT-2's vocab.bpe and encoder.json on this machine, and {err}; nothing is "
            f"downloaded. Either download both from {GPT2_URL} into a folder and set data.gpt2_dir=FOLDER, or "
            "run `python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\"` once online with TIKTOKEN_CACHE_DIR "
            "set to a folder and copy that folder here (same TIKTOKEN_CACHE_DIR). Or use data.tokenizer=bpe, trained "
            "on your corpus."
        ) from None


def pretrained_tokenizer(cfg: DataConfig) -> PretrainedTokenizer:
    """data.tokenizer=pretrained: the tokenizer.json of data.tokenizer_dir (read once per process
    while its files stay unchanged)."""
    assert cfg.tokenizer_dir is not None
    path = Path(cfg.tokenizer_dir).expanduser()
    stamps = tuple((f.stat().st_mtime_ns, f.stat().st_size) if f.is_file() else None
                   for f in (path / name for name in ("tokenizer.json", "config.json", "tokenizer_config.json",
                                                      "generation_config.json")))
    return _pretrained(cfg.tokenizer_dir, str(path.resolve()) if path.is_dir() else cfg.tokenizer_dir, stamps)


@functools.lru_cache(maxsize=4)
def _pretrained(location: str, _resolved: str, _stamps: tuple) -> PretrainedTokenizer:
    return PretrainedTokenizer.from_folder(location, "data.tokenizer_dir")


def pretrained_identity(cfg: DataConfig) -> dict:
    """What makes a pretrained tokenizer's ids: tokenizer.json's content and the end-of-text id."""
    tokenizer = pretrained_tokenizer(cfg)
    content = hashlib.sha256(Path(cfg.tokenizer_dir or "").expanduser().joinpath("tokenizer.json").read_bytes())
    return {"tokenizer_sha256": content.hexdigest(), "eos_id": tokenizer.eos_id}


def chat_template(cfg: DataConfig) -> ChatTemplate | None:
    """data=instruct with a folder's tokenizer: the folder's chat template, compiled and tried on a
    probe conversation (ConfigError when it is broken); None otherwise, or when the folder has none
    (llmtrain's own format is used then). Read once per process while the folder's files stay
    unchanged."""
    if cfg.source is not DataSource.instruct or cfg.tokenizer is not TokenizerKind.pretrained:
        return None
    tokenizer = pretrained_tokenizer(cfg)
    path = Path(cfg.tokenizer_dir or "").expanduser()
    stamps = tuple((f.stat().st_mtime_ns, f.stat().st_size) if f.is_file() else None
                   for f in (path / name for name in ("tokenizer.json", "tokenizer_config.json", TEMPLATE_FILE)))
    special = tuple(t.content for t in tokenizer.inner.get_added_tokens_decoder().values() if t.special)
    return _chat_template(cfg.tokenizer_dir or "", str(path.resolve()), stamps, special)


@functools.lru_cache(maxsize=4)
def _chat_template(location: str, resolved: str, _stamps: tuple, special: tuple[str, ...]) -> ChatTemplate | None:
    template = find_template(Path(resolved), list(special))
    return checked(template, location) if template is not None else None


def hf_dataset(cfg: DataConfig):
    """The data=hf dataset, loaded once per process (the CLI's pre-validation and the run share it)."""
    assert cfg.hf_name is not None
    return _load_hf(cfg.hf_name, cfg.hf_config, cfg.hf_split, cfg.path, cfg.text_field)


@functools.lru_cache(maxsize=4)
def _load_hf(name: str, config: str | None, split: str, data_files: str | None, text_field: str):
    return load_hf_dataset(name, config, split, data_files, text_field)


def current_fingerprint(cfg: DataConfig, files: list[SourceFile]) -> str:
    """Cheap staleness check: the files' names, sizes and mtimes; for data=hf, the dataset's own
    fingerprint (datasets derives it from the data it loaded)."""
    if cfg.source is DataSource.hf:
        return f"hf:{hf_dataset(cfg)._fingerprint}"
    return fingerprint(files)


def cached_meta(cfg: DataConfig) -> dict | None:
    """The metadata of already prepared, up-to-date data for `cfg`, or None (nothing is built).
    data=hf is taken as prepared without loading the dataset (prepare_data checks it properly)."""
    files, directory = location(cfg)
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = read_json(meta_path, "the prepared data's metadata")
    except UnreadableFile:  # damaged (a crash of an older llmtrain, a hand edit): prepared again
        return None
    return (meta if isinstance(meta, dict)
            and (cfg.source is DataSource.hf or meta.get("fingerprint") == fingerprint(files)) else None)


def cached_data(cfg: DataConfig) -> PreparedData | None:
    """The prepared, up-to-date data for `cfg` when it is in the cache; None otherwise (nothing is
    built: for readers, like the post-run report, that must not tokenize a corpus)."""
    meta = cached_meta(cfg)
    return PreparedData(location(cfg)[1], meta) if meta is not None else None
