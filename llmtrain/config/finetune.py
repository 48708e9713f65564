"""The `finetune` group: what trains (every weight, or LoRA adapters on frozen weights, QLoRA's
stored in 4 bits), its keys' dataclass and their checks. Kept beside schema.py, which holds the
root `Config` that includes it (schema.py re-exports these names). No torch."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from llmtrain.core.errors import ConfigError

# The functions below take a schema.py `Config`, typed Any: schema.py imports this module.
Config = Any


class FinetuneMethod(str, Enum):
    full = "full"
    lora = "lora"
    qlora = "qlora"  # lora on a base whose linear weights are stored in 4-bit NF4 (llmtrain/qlora.py)


# QLoRA's NF4 stores each weight in blocks of 64 values (qlora.py NF4_RECORD); every linear layer of a
# block reads or writes the model's width, so a width that 64 divides makes every one of them fit.
NF4_BLOCK = 64


# The projections LoRA adapters can go on, named by what they are: the attention's fused q/k/v
# projection (three adapters, one per q, k and v), its output projection, the MLP's projections
# (gate, up and down), and the LM head.
LORA_TARGETS = ("attn_qkv", "attn_out", "mlp", "head")
DEFAULT_LORA_TARGETS = ["attn_qkv", "attn_out"]  # torchtune's default: q, k, v and the attention output

# optim.lr=null under LoRA with an Adam-family optimizer: the adapters' LR, whatever the width. The
# value of litgpt's LoRA recipes (config_hub/finetune/*/lora.yaml) and of the QLoRA paper for models
# up to 13B (torchtune's LoRA recipes use 3e-4; peft's examples 1e-4 to 3e-4). A full-training LR
# shrinks with the width because every weight moves; an adapter starts at zero and its update is
# scaled by alpha / rank instead, so the usual practice keeps one value across sizes.
LORA_ADAM_LR = 2e-4


def _f(default: Any, doc: str) -> Any:
    """A dataclass field with a one-line doc (schema.py's helper; this module cannot import it)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": doc})
    return field(default=default, metadata={"help": doc})


@dataclass
class FinetuneConfig:
    method: FinetuneMethod = _f(
        FinetuneMethod.full, "What trains: full (every weight), lora (low-rank adapters beside the frozen weights "
        "of finetune.targets; usually with model.init_from) or qlora (lora on frozen weights stored in 4-bit NF4 "
        "through torchao; needs model.init_from, one process).")
    rank: int = _f(8, "lora: the rank r of each adapter (A is r x in, B is out x r).")
    alpha: float = _f(16.0, "lora: the adapters' output is scaled by alpha / rank.")
    dropout: float = _f(0.0, "lora: dropout on each adapter's input (0 <= dropout < 1).")
    targets: list[str] = _f(
        DEFAULT_LORA_TARGETS, "lora: the projections that get adapters: attn_qkv (q, k and v, one adapter each), "
        "attn_out, mlp (gate, up, down) and head.")


def is_lora(cfg: Config) -> bool:
    """Whether the run trains LoRA adapters on frozen weights: finetune=lora, or qlora (the same
    adapters, checkpoints, LR default and exports, on a base stored in 4 bits). A config from before
    the group has none: full."""
    finetune = getattr(cfg, "finetune", None)
    # == and `in`: the method may be a str too (a config built in code)
    return finetune is not None and finetune.method in (FinetuneMethod.lora, FinetuneMethod.qlora)


def quantized_base(cfg: Config) -> bool:
    """Whether the frozen base is stored in 4-bit NF4 (finetune=qlora): what QLoRA adds to LoRA."""
    finetune = getattr(cfg, "finetune", None)
    return finetune is not None and finetune.method == FinetuneMethod.qlora


def torchao_installed() -> bool:
    """torchao, the optional `ao` extra: optim=adamw8bit/adamw4bit and finetune=qlora need it."""
    return importlib.util.find_spec("torchao") is not None


def adapter_checkpoints(cfg: Any) -> bool:
    """Whether the run's checkpoints and model.pt hold its adapters alone: a LoRA run on a folder's
    weights (model.init_from), which a resume or a reader loads again from the folder. A LoRA run
    from scratch keeps whole-model files: its frozen base exists nowhere else."""
    return is_lora(cfg) and cfg.model.init_from is not None


def validate_finetune(cfg: Config, shards: int, replicas: int = 1) -> None:
    """The finetune keys, and what LoRA cannot run with in this version (`shards`, `replicas`: the
    run's FSDP and replica degrees, parallel.dp_shard and dp_replicate resolved); ConfigError, one
    paragraph."""
    f = cfg.finetune
    if not is_lora(cfg):
        return
    where = f"finetune.method={getattr(f.method, 'value', f.method)}"
    _require(isinstance(f.rank, int) and f.rank >= 1,
             f"'finetune.rank' is {f.rank}; use a positive adapter rank (typical: 8, 16, 64).")
    _require(0 < f.alpha < math.inf, f"'finetune.alpha' is {f.alpha}; use a finite number > 0 (the adapters' "
             "output is scaled by alpha / rank; typical: twice the rank, e.g. 16 for rank 8).")
    _require(0.0 <= f.dropout < 1.0, f"'finetune.dropout' is {f.dropout}; valid range is 0 <= dropout < 1 (0 "
             "switches it off).")
    unknown = [t for t in f.targets if t not in LORA_TARGETS]
    _require(not unknown, f"'finetune.targets' has {', '.join(map(repr, unknown))}; valid targets: "
             f"{', '.join(LORA_TARGETS)} (e.g. finetune.targets=[attn_qkv,attn_out,mlp]).")
    _require(bool(f.targets), f"'finetune.targets' is empty, so {where} would train nothing; name at least one of "
             f"{', '.join(LORA_TARGETS)} (the default: [attn_qkv,attn_out]).")
    _require(len(set(f.targets)) == len(f.targets),
             f"'finetune.targets' ({', '.join(f.targets)}) names a target twice; name each once.")
    _require("head" not in f.targets or not cfg.model.tie_weights,
             "'finetune.targets' has head, but model.tie_weights=true shares the head with the token embedding, and "
             "an adapter on it would untie them (the merged export would hold two tables); drop head from "
             "finetune.targets, or train a model with model.tie_weights=false.")
    if quantized_base(cfg):  # before LoRA's parallel checks, whose advice (ddp, fsdp) QLoRA cannot take
        _validate_qlora(cfg, shards, replicas)
    p = cfg.parallel
    split = [f"parallel.{key}={value}" for key, value in (("tp", p.tp), ("pp", p.pp)) if value != 1]
    _require(not split, f"{where} does not run under tensor or pipeline parallel yet ({', '.join(split)}): the "
             "adapters are not split over the ranks. A LoRA run's frozen weights need no gradients or optimizer "
             "state, so one device or parallel=ddp usually fits; use one of those.")
    # ZeRO-1 splits the optimizer state, which under LoRA is the adapters' alone (a few % of the
    # weights' bytes): nothing worth the broadcasts, and untested with frozen weights.
    _require(not p.zero1,
             f"{where} does not run with parallel.zero1 (ZeRO-1): it would split only the adapters' optimizer state, "
             "a few percent of the weights' size, so it saves next to nothing; use parallel=ddp, or parallel=fsdp to "
             "shard the frozen weights too.")
    _require(shards == 1 or replicas == 1,
             f"{where} does not run under HSDP yet ({replicas} replicas x {shards} shards): it is untested; use "
             "parallel=fsdp (shards only) or parallel=ddp (replicas only).")
    # FSDP2 works (tested: 2 ranks train as one process, and resume) with whole checkpoint files.
    _require(shards == 1 or str(getattr(cfg.checkpoint.format, "value", cfg.checkpoint.format)) != "sharded",
             f"{where} under FSDP2 writes whole checkpoint files (the adapters and their optimizer state are a small "
             "fraction of the model, and the frozen weights are the folder's or, from scratch, gathered once per "
             "save); checkpoint.format=sharded is not supported with it: use checkpoint.format=auto or full.")


def _validate_qlora(cfg: Config, shards: int, replicas: int) -> None:
    """What QLoRA needs beyond LoRA: torchao, a base folder, one process and a width NF4 blocks fit."""
    _require(torchao_installed(),
             "finetune.method=qlora stores the frozen base weights in 4-bit NF4 through torchao, and the torchao "
             "package is not installed; pip install 'llmtrain[ao]' (or pip install torchao), or use finetune=lora "
             "(the same adapters on a full-precision base: 4 bytes a frozen weight instead of ~0.52).")
    _require(cfg.model.init_from is not None,
             "finetune.method=qlora needs model.init_from (a Hugging Face model folder): QLoRA quantizes a trained "
             "base to 4 bits and trains adapters to correct it, and a randomly initialized model quantized and frozen "
             "is noise the adapters cannot make a model of. Set model.init_from=FOLDER, or train from scratch with "
             "finetune=full (every weight) or finetune=lora.")
    p = cfg.parallel
    processes = shards * replicas * p.tp * p.pp
    degrees = [f"{name}={value}" for name, value in (("dp_shard", shards), ("dp_replicate", replicas),
                                                      ("tp", p.tp), ("pp", p.pp)) if value != 1]
    _require(not degrees,
             f"finetune.method=qlora runs in one process on one device, and this run has {processes} processes "
             f"({', '.join(degrees)}): llmtrain's QLoRA is single-GPU fine-tuning, and its 4-bit base weights are not "
             "split or replicated over processes. Use parallel=single (the default) with parallel.nproc=1, or "
             "finetune=lora, which runs under parallel=ddp and parallel=fsdp.")
    _require(cfg.model.n_embd % NF4_BLOCK == 0,
             f"finetune.method=qlora stores weights in NF4 blocks of {NF4_BLOCK} values, and the base's width "
             f"model.n_embd={cfg.model.n_embd} is not a multiple of {NF4_BLOCK}, so its layers do not split into them; "
             "use finetune=lora for this model.")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
