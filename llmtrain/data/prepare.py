"""Raw corpus -> memory-mapped train/val token files, prepared once and cached.

cache.py says where a config's prepared data lives and whether it is up to date; `prepare_data`
decides what to do about it. An unchanged fingerprint reuses the files at once; a changed
fingerprint with an unchanged content hash only refreshes the fingerprint; changed content
rebuilds: text is scanned (scan.py), its tokenizer fitted (fit.py) and its tokens written
(build.py); instruction data is built in memory (instructions.py). meta.json is meta.py's
`DataMeta`; the progress bar (progress.py) shows how far a build is."""

from __future__ import annotations

import json
from collections.abc import Callable

from llmtrain.config.schema import DataConfig, DataSource
from llmtrain.core.atomic import write_atomically
from llmtrain.data.build import build_text
from llmtrain.data.cache import PreparedData, current_fingerprint, location
from llmtrain.data.corpus import content_hash
from llmtrain.data.instructions import build_instructions, read_instructions
from llmtrain.data.progress import ProgressBar
from llmtrain.data.scan import scan_corpus


def prepare_data(cfg: DataConfig, log: Callable[[str], None] = print, progress: bool = False) -> PreparedData:
    """Return the prepared data for `cfg`, building it only when missing or stale. `progress` shows
    a live bar (bytes, documents, tokens/s, ETA) on stderr while a build runs."""
    files, directory = location(cfg)
    meta_path = directory / "meta.json"
    quick = current_fingerprint(cfg, files)
    with ProgressBar(progress) as bar:
        log = bar.routed(log)
        if meta_path.is_file():
            # Read as a dict, whatever llmtrain version wrote it (DataMeta is the writing side only).
            meta = json.loads(meta_path.read_text())
            if meta.get("fingerprint") == quick:
                return PreparedData(directory, meta)
            if cfg.source is DataSource.instruct:
                raw = read_instructions(cfg, files)
                digest, scan = content_hash(raw), None
            else:
                scan = scan_corpus(cfg, files, bar)
                digest = scan.content_sha256
            if meta.get("content_sha256") == digest:
                meta["fingerprint"] = quick
                write_atomically(meta_path, json.dumps(meta, indent=2))
                return PreparedData(directory, meta)
            log(f"data source changed since it was prepared; preparing again into {directory}")
        else:
            log(f"preparing {cfg.source.value} data ({cfg.tokenizer.value} tokens) into {directory}")
            scan = raw = None
        if cfg.source is DataSource.instruct:
            return build_instructions(cfg, raw or read_instructions(cfg, files), quick, directory, log)
        return build_text(cfg, files, scan or scan_corpus(cfg, files, bar), quick, directory, log, bar)
