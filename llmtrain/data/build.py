"""A scanned corpus -> its cache folder: token files, tokenizer.json and meta.json, whole or not at all.

`build_text` decides which documents are kept and where each goes, fits the tokenizer (fit.py),
streams each split's tokens into its token file (token_files.py) and writes the folder. Every
build, text or instruction data (`write_build`), goes to a temporary folder beside the real one
(`fresh_tmp`) that is swapped into place only when whole (`commit`, core/atomic.py's `swap_folder`),
so an interrupted prepare never leaves half-written tokens under the real name."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from llmtrain.config.schema import DataConfig, DataSource, DecodeErrors
from llmtrain.core.atomic import swap_folder, write_file
from llmtrain.core.files import TOKENIZER  # the same file name in the data cache as in a run dir
from llmtrain.data.cache import PreparedData, decoded_files
from llmtrain.data.corpus import SourceFile
from llmtrain.data.fit import fit_tokenizer
from llmtrain.data.meta import DataMeta, file_facts
from llmtrain.data.progress import ProgressBar
from llmtrain.data.scan import Scan, assign_splits, split_pieces, tail_cut_guess
from llmtrain.data.token_files import TokenWriter
from llmtrain.data.tokenizers import Tokenizer, save_tokenizer


def build_text(
    cfg: DataConfig, files: list[SourceFile], scan: Scan, quick: str, directory: Path, log: Callable[[str], None],
    bar: ProgressBar,
) -> PreparedData:
    """Plain text, streamed: documents are read in pieces, split by document, tokenized in batches and
    appended to the split's token file with end-of-text after every document."""
    keep, decoded = _kept_documents(cfg, files, scan, log)
    kept = [i for i, k in enumerate(keep) if k]
    # One document (a single file) is one stream: its tail, cut at a line break, is validation.
    tail_cut = tail_cut_guess(scan.sizes[kept[0]], cfg.val_fraction) if len(kept) == 1 else None
    is_val = bytearray(len(keep)) if tail_cut is not None else assign_splits(scan.buckets, keep, cfg.val_fraction)

    tokenizer = fit_tokenizer(cfg, files, scan, keep, is_val, tail_cut, log, bar)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    tmp = fresh_tmp(directory)
    writers: dict[str, TokenWriter] = {}
    try:
        writers = {split: TokenWriter(tmp / f"{split}.bin", tokenizer, dtype) for split in ("train", "val")}
        bar.start("tokenizing", sum(scan.sizes[i] for i in kept))
        for split, text, end_of_document in split_pieces(cfg, files, scan, keep, is_val, tail_cut):
            writers[split].add(text, end_of_document)
            bar.advance(len(text), documents=int(end_of_document), tokens=writers[split].flush_if_full())
        for writer in writers.values():
            bar.advance(0, tokens=writer.close())
        train, val = writers["train"], writers["val"]
        meta = DataMeta.of_tokens(
            cfg, tokenizer, dtype, train.counts,
            documents=len(kept),
            train_documents=len(kept) - sum(is_val) if tail_cut is None else 1,
            val_documents=sum(is_val) if tail_cut is None else 1,
            undecodable_documents=len(scan.valid) - sum(scan.valid),
            source_bytes=sum(scan.sizes),
            train_tokens=train.tokens,
            val_tokens=val.tokens,
            **file_facts(scan.file_facts),
            decoded_from=decoded,
            fingerprint=quick,
            content_sha256=scan.content_sha256,
        )
        return seal(tmp, directory, tokenizer, meta)
    finally:
        for writer in writers.values():
            writer.file.close()  # already closed after a whole build; an interrupted one leaves them open
        shutil.rmtree(tmp, ignore_errors=True)


def _kept_documents(
    cfg: DataConfig, files: list[SourceFile], scan: Scan, log: Callable[[str], None]
) -> tuple[bytearray, dict[str, str]]:
    """1 for each document the build keeps (data.decode_errors=skip leaves out those not UTF-8), and
    the files decoded from UTF-16/32; both logged. A corpus with nothing to keep is a ConfigError."""
    from llmtrain.core.errors import ConfigError

    skip = cfg.decode_errors is DecodeErrors.skip
    keep = bytearray(v or not skip for v in scan.valid)
    undecodable = len(scan.valid) - sum(scan.valid)
    if undecodable:
        action = "skipped" if skip else "invalid bytes replaced by U+FFFD"
        log(f"{undecodable} document(s) are not valid UTF-8 ({action}; data.decode_errors=replace|skip), "
            f"e.g. {scan.first_invalid}")
    decoded = decoded_files(cfg, files)
    log_decoded(decoded, log)
    if not scan.valid:
        raise ConfigError(f"The data ({describe(cfg)}) holds no text: every document is empty (an empty file, an "
                          f"empty '{cfg.text_field}' field or row); give documents with text.")
    if not any(keep):
        raise ConfigError(f"The data ({describe(cfg)}) gave no usable text: every document was skipped as not "
                          "UTF-8 (data.decode_errors=skip); give UTF-8 text or use data.decode_errors=replace.")
    return keep, decoded


def log_decoded(decoded: dict[str, str], log: Callable[[str], None]) -> None:
    """Say once which files were decoded from UTF-16/32 (a long list: the first few)."""
    if 0 < len(decoded) <= 3:
        for name, encoding in decoded.items():
            log(f"{name}: {encoding} (byte-order mark), decoded as such")
    elif decoded:
        examples = ", ".join(f"{name} ({encoding})" for name, encoding in list(decoded.items())[:3])
        log(f"{len(decoded)} files start with a UTF-16/32 byte-order mark and were decoded as such, e.g. {examples}")


def describe(cfg: DataConfig) -> str:
    """The data source as the user gave it, for an error message."""
    return {DataSource.hf: f"data.hf_name={cfg.hf_name}", DataSource.python_stdlib: "the stdlib"}.get(
        cfg.source, f"data.path={cfg.path}")


def fresh_tmp(directory: Path) -> Path:
    """An empty build folder next to `directory`; the build lands under the real name only whole."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def commit(tmp: Path, directory: Path) -> None:
    """Rename a finished build folder into place (the previous version is removed only after)."""
    try:
        swap_folder(tmp, directory)
    except OSError:
        if not (directory / "meta.json").is_file():
            raise
        # Another process finished the same build first: its files are as good as ours.


def seal(tmp: Path, directory: Path, tokenizer: Tokenizer, meta: DataMeta) -> PreparedData:
    """Finish a build folder whose token files are written: its tokenizer and meta.json, then swap it
    into place."""
    save_tokenizer(tokenizer, tmp / TOKENIZER)
    write_file(tmp / "meta.json", meta.to_json())
    commit(tmp, directory)
    return PreparedData(directory, meta.to_dict(), built=True)


def write_build(directory: Path, arrays: dict[str, np.ndarray], tokenizer: Tokenizer, meta: DataMeta) -> PreparedData:
    """Into a temporary folder, fsynced, then renamed into place: never half-written under the real name."""
    tmp = fresh_tmp(directory)
    try:
        for name, arr in arrays.items():
            with open(tmp / name, "wb") as fh:  # not write_file: its sha256 would cost a pass over every token
                if name.endswith(".npy"):
                    np.save(fh, arr)
                else:
                    arr.tofile(fh)
                fh.flush()
                os.fsync(fh.fileno())
        return seal(tmp, directory, tokenizer, meta)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
