"""torch.compile for a GPT's blocks (`compile=on|auto`), and the record of what compiling measured on
this machine, which `compile=auto` decides from (training/compile_trial.py measures it).

Each block's `forward` is compiled, not the block's whole call (`Module.compile()`) nor the whole model:
- the module hooks stay outside the compiled code. The monitor's activation probe is a forward hook
  installed for one sampled step; inside a compiled call torch does not guard on hooks added later
  (torch._dynamo.config.skip_nnmodule_hook_guards), so the probe would silently record nothing;
- every block runs the same code on the same shapes: they share one compiled graph, and compiling
  costs one block's time however deep the model;
- the parameters keep their names (no `_orig_mod.` prefix): checkpoints move freely between compiled
  and eager runs, and un-compiling is deleting the instance's `forward`;
- the embedding, the final norm, the head and the loss stay eager: one matmul and a cross-entropy,
  with little for a compiler to fuse.

Numerics: Inductor fuses and reorders floating-point work, so a compiled step's loss differs from the
eager step's in the last bits (measured: within 1e-5 relative after 20 steps; tests/test_compile.py
holds it to 1e-4). A run with compile on is repeatable, but not bitwise equal to the same run eager,
and a resume matches an uninterrupted run to that tolerance, not bitwise.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmtrain.core.atomic import write_atomically
from llmtrain.core.cache_home import cache_home

RECORD_FILE = "compile.json"
# A decision measured on this machine is trusted this long; after that it is measured again (a torch
# upgrade, a new kernel or BIOS setting can change it). torch's version is in the key anyway.
RECORD_MAX_AGE_S = 30 * 24 * 3600


def compile_blocks(model: nn.Module) -> None:
    """Compile each of `model.blocks`' forward in place (idempotent). Inductor's kernels go to
    llmtrain's cache folder unless TORCHINDUCTOR_CACHE_DIR says where: its default is under /tmp,
    which a reboot empties, and a cold compile costs ~30 s on a CPU against ~3 s from the cache."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        inductor_cache = cache_home() / "inductor"
        try:
            inductor_cache.mkdir(parents=True, exist_ok=True)
        except OSError:  # a read-only home: torch's default under /tmp, rather than a compile that fails
            pass
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)
    if "TORCHINDUCTOR_CPP_DYNAMIC_THREADS" not in os.environ:
        # CPU kernels that read the thread count when they run, instead of having it written in when
        # they compile: threads=auto may change the count mid-run (training/threads_follow.py), and a
        # kernel compiled for another count would be compiled again (measured: 10 s from a cold cache,
        # against 0.2 s with this on).
        import torch._inductor.config as inductor_config

        inductor_config.cpp.dynamic_threads = True
    for block in model.blocks:
        if "forward" not in vars(block):
            block.forward = torch.compile(block.forward)


def uncompile_blocks(model: nn.Module) -> None:
    """Back to eager: the class's forward again (the compiled code stays in torch's caches)."""
    for block in model.blocks:
        vars(block).pop("forward", None)


def blocks_compiled(model: nn.Module) -> bool:
    """Whether any part of `model` runs through torch.compile: a block's forward (compile_blocks), a
    module's whole call (`Module.compile()`), or an OptimizedModule (`torch.compile(model)`, which
    keeps the original as `_orig_mod`)."""
    return any("forward" in vars(m) and hasattr(vars(m)["forward"], "_torchdynamo_orig_callable")
               or getattr(m, "_compiled_call_impl", None) is not None or hasattr(m, "_orig_mod")
               for m in model.modules())


def cpu_compiler() -> str | None:
    """The C++ compiler Inductor builds CPU kernels with ($CXX, else g++; clang++ on macOS, cl on
    Windows), found on the PATH; None where there is none (compiling on the CPU would fail mid-run)."""
    default = "cl" if sys.platform == "win32" else "clang++" if sys.platform == "darwin" else "g++"
    return shutil.which(os.environ.get("CXX") or default)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), for the record's key: a decision measured on one
    CPU says little of another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def decision_key(cfg: Any, device: torch.device, threads: int, seq_len: int) -> str:
    """What a compile decision depends on: the machine (device, CPU, threads), torch, and the block's
    work (its shape, micro-batch, sequence length, precision, what trains and what is recomputed)."""
    m = cfg.model
    shape = (f"d{m.n_embd} h{m.n_head} kv{m.n_kv_head} mlp{m.mlp.value}x{m.mlp_ratio} {m.norm.value} "
             f"{m.position.value} bias{int(m.bias)} drop{m.dropout} ckpt{m.activation_checkpointing.value}")
    finetune = getattr(getattr(cfg, "finetune", None), "method", "full")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return (f"torch {torch.__version__} | {device.type} {where} | {threads} threads | {shape} | "
            f"micro-batch {cfg.micro_batch_size} x {seq_len} | {cfg.precision.name.value} | "
            f"{getattr(finetune, 'value', finetune)}")


class CompileRecords:
    """The compile decisions measured on this machine, one JSON file in llmtrain's cache folder
    ($LLMTRAIN_CACHE or ~/.cache/llmtrain), keyed by `decision_key`. Reading never fails a run: an
    unreadable file is no record (measured again); a failed write loses only the record."""

    def __init__(self, root: Path | None = None, clock: Any = time.time) -> None:
        self.root = root if root is not None else cache_home()
        self.path = self.root / RECORD_FILE
        self.clock = clock

    def _read(self) -> dict[str, Any]:
        try:
            records = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return records if isinstance(records, dict) else {}

    def get(self, key: str) -> dict[str, Any] | None:
        """The record for `key` if it is recent and well formed (a `faster` flag, the two step times)."""
        record = self._read().get(key)
        if not isinstance(record, dict) or not isinstance(record.get("faster"), bool):
            return None
        measured = record.get("measured_at")
        if not isinstance(measured, (int, float)) or self.clock() - measured > RECORD_MAX_AGE_S:
            return None
        return record

    def put(self, key: str, record: dict[str, Any]) -> bool:
        """Store `record` (stamped with the time) under `key`; False if it could not be written."""
        records = self._read()
        records[key] = {**record, "measured_at": self.clock()}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path, json.dumps(records, indent=1, sort_keys=True).encode())
        except OSError:
            return False
        return True
