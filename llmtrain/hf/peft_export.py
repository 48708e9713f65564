"""`llmtrain export RUN_DIR --format peft`: a LoRA run's adapters as peft writes them, for
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), DIR)`.

adapter_config.json (peft's LoraConfig: r, lora_alpha, target_modules under transformers' module
names, base_model_name_or_path: the run's model.init_from folder) and adapter_model.safetensors
(`base_model.model.<module>.lora_A.weight`, rank x in, and `.lora_B.weight`, out x rank), with the
run's tokenizer files, as an hf export has them. No peft code is needed to write it.

Each llmtrain adapter part maps to one transformers module through hf/layouts.py's tensor map: the
fused q/k/v adapter's parts q, k and v become Llama's q_proj, k_proj and v_proj. GPT-2's c_attn is
one module (a Conv1D, rows q | k | v), so its three parts become one adapter of rank 3r: A stacked
(A_q; A_k; A_v), B block-diagonal, so B A = (B_q A_q; B_k A_k; B_v A_v), exactly the fused
adapter's rows. peft scales by lora_alpha / r, so that module gets rank_pattern 3r and
alpha_pattern 3 alpha: the same alpha / r. peft's LoRA on a Conv1D keeps A as (r, in) and B as
(out, r) (only merging transposes, under fan_in_fan_out), so the tensors are the same either way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from llmtrain.config.finetune import FinetuneConfig, FinetuneMethod
from llmtrain.config.schema import ModelConfig
from llmtrain.hf import layouts
from llmtrain.hf.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, EXPORT_MARK, check_target, write_export
from llmtrain.hf.tokenizer_files import tokenizer_files
from llmtrain.lora import PART_ORDER

PREFIX = "base_model.model."  # where peft's PeftModelForCausalLM keeps the transformers model
_LAYER = re.compile(r"^(model\.layers|transformer\.h)\.\d+\.")  # a layer's prefix: target_modules name the rest


def peft_tensors(cfg: ModelConfig, adapters: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """(peft's tensors, {target module: how many llmtrain parts it stacks}) of llmtrain adapters."""
    layout = layouts.layout_of_model(cfg)
    modules_of = {piece.ours.removesuffix(".weight"): [name.removesuffix(".weight") for name in piece.theirs]
                  for piece in layouts.pieces(cfg, layout) if piece.ours.endswith(".weight")}
    layers = sorted({name[: -len(".lora_scaling")] for name in adapters if name.endswith(".lora_scaling")})
    tensors: dict[str, torch.Tensor] = {}
    stacked: dict[str, int] = {}
    for layer in layers:
        parts = sorted((name.rsplit(".", 1)[1] for name in adapters if name.startswith(f"{layer}.lora_b.")),
                       key=PART_ORDER.index)
        a = [adapters[f"{layer}.lora_a.{p}"].detach().cpu() for p in parts]
        b = [adapters[f"{layer}.lora_b.{p}"].detach().cpu() for p in parts]
        modules = modules_of.get(layer)
        if modules is None or len(modules) not in (1, len(parts)):
            raise layouts.UnsupportedModel(f"the adapter on {layer} has no {layout} module to go on")
        if len(modules) == len(parts):  # one transformers module per part (Llama's q_proj, k_proj, v_proj)
            pairs = list(zip(modules, a, b, strict=True))
        else:  # one module over several row blocks (GPT-2's c_attn): A stacked, B block-diagonal
            pairs = [(modules[0], torch.cat(a, dim=0), torch.block_diag(*b))]
            stacked[_LAYER.sub("", modules[0])] = len(parts)
        for module, lora_a, lora_b in pairs:
            tensors[f"{PREFIX}{module}.lora_A.weight"] = lora_a.contiguous()
            tensors[f"{PREFIX}{module}.lora_B.weight"] = lora_b.contiguous()
    return tensors, stacked


def adapter_config(cfg: ModelConfig, finetune: FinetuneConfig, tensors: dict[str, torch.Tensor],
                   stacked: dict[str, int], base: str) -> dict[str, Any]:
    """peft's adapter_config.json for these tensors."""
    targets = sorted({_LAYER.sub("", name[len(PREFIX):].removesuffix(".lora_A.weight"))
                      for name in tensors if name.endswith(".lora_A.weight")})
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": finetune.rank, "lora_alpha": finetune.alpha, "lora_dropout": finetune.dropout,
        "target_modules": targets, "bias": "none",
        # a stacked module: rank k r and alpha k alpha, so its scaling is the run's alpha / rank
        "rank_pattern": {module: k * finetune.rank for module, k in stacked.items()},
        "alpha_pattern": {module: k * finetune.alpha for module, k in stacked.items()},
        "fan_in_fan_out": layouts.layout_of_model(cfg) == layouts.GPT2,  # GPT-2's Conv1D stores (in, out)
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "use_rslora": False,
        "use_dora": False,
    }


# adapter_model.safetensors' metadata key naming a QLoRA run's base quantization ("nf4"): peft ignores it
QUANTIZED_BASE = "llmtrain_base_quantization"


def export_peft(cfg: ModelConfig, finetune: FinetuneConfig, adapters: dict[str, torch.Tensor], base: str,
                tokenizer: dict[str, Any], context: int, out_dir: Path) -> None:
    """Write the adapters (llmtrain's names, with their scalings) as a peft adapter folder for the
    base folder `base`, with the tokenizer's files; everything built in memory first. A QLoRA
    run's adapters are written as they are (they are LoRA adapters): they were trained against the
    base quantized to NF4, which the file's metadata says (QUANTIZED_BASE)."""
    tensors, stacked = peft_tensors(cfg, adapters)
    config = adapter_config(cfg, finetune, tensors, stacked, base)
    _, files = tokenizer_files(tokenizer, context)
    files[ADAPTER_CONFIG] = json.dumps(config, indent=2)
    out_dir = check_target(out_dir)

    def fill(folder: Path) -> None:
        from safetensors.torch import save_file

        for name, text in files.items():
            (folder / name).write_text(text)
        # the mark in the metadata, not in adapter_config.json: peft warns about keys it does not know
        quantized = {QUANTIZED_BASE: "nf4"} if finetune.method == FinetuneMethod.qlora else {}
        save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt", EXPORT_MARK: "true", **quantized})

    write_export(out_dir, fill)
