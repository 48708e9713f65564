"""QLoRA (Dettmers et al. 2023): finetune=qlora is finetune=lora (lora.py's adapters, unchanged) on
a frozen base whose linear weights are stored in 4-bit NormalFloat (NF4) through torchao.

Which weights: every linear layer's weight in the blocks (attention q/k/v and output projections,
the MLP's gate, up and down), adapted or not, and the head's when it has an adapter. That is
torchtune's QLoRA (its FrozenNF4Linear holds the projections without an adapter) and nearly all of a
model's bytes; the embedding, the norms, biases and an unadapted head keep their dtype, as in
torchtune and in peft's bitsandbytes QLoRA (which leaves lm_head out too).

How: torchao's `to_nf4` with its (and torchtune's, and the QLoRA paper's) blocks of 64 values,
each block's scale double-quantized to int8 in blocks of 256 scales. A tensor whose count of
64-value blocks 256 does not divide (tiny test models; a real model's layers have multiples of 256)
takes the largest divisor of it below 256 instead, which torchao requires to divide.

The forward needs no code of its own: an `nn.Linear` (or `LoRALinear`) whose weight is an
NF4Tensor computes `F.linear` through torchao's handler, which is `linear_nf4(x, w) + bias`: the
weight dequantized to the input's dtype for the product, and again in backward for the input's
gradient (the weight gets none). The adapters' path is lora.py's.

Quantizing is a pure function of the weights (no randomness, no state): a resume re-quantizes the
folder's weights to the same bits, and a reader of the run (sample, eval, export) rebuilds exactly
the base the adapters trained on with `dequantized_base`. The run dir's base record (lora_base.json,
and each checkpoint's) names the quantization (`NF4_RECORD`), so a reader dequantizes as the run
quantized, whatever a later llmtrain's defaults become.

torchao is imported on first use (the optional `ao` extra; config validation refuses qlora without
it): everything else here imports no torchao, so the estimate and the banner can count NF4 bytes.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from llmtrain.config.finetune import NF4_BLOCK
from llmtrain.core.errors import UserError
from llmtrain.core.quiet import quiet_torchao

# torchao's, torchtune's and the QLoRA paper's: 64 values a block, 256 block scales a scale block
NF4_RECORD: dict[str, Any] = {"format": "nf4", "block_size": NF4_BLOCK, "scaler_block_size": 256}
NF4_LOOKUP_BYTES = 16 * 4  # the 16 NF4 levels, a float32 table kept with each tensor

# the block linears' weights by their llmtrain state-dict names (lora.py's targets, attn_qkv..mlp)
_BLOCK_LINEAR = re.compile(r"^blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(gate|up|down))\.weight$")
HEAD = "lm_head.weight"
HEAD_ADAPTER = "lm_head.lora_"  # lora.py ADAPTER_MARK: a state's (or a model's) names have it when the head is adapted


def quantized_names(names: Iterable[str]) -> list[str]:
    """Of a QLoRA model's state-dict names (a built model's, or a folder's weights with the run's
    adapters beside them), the weights stored in NF4: the rule training and readers share."""
    names = list(names)
    head = any(n.startswith(HEAD_ADAPTER) for n in names)
    return [n for n in names if _BLOCK_LINEAR.match(n) or (head and n == HEAD)]


def scaler_block_size(numel: int, record: dict[str, Any] = NF4_RECORD) -> int:
    """The double quantization's block (in scales) for a tensor of `numel` values: the record's
    (256), or the largest divisor below it of the tensor's count of 64-value blocks."""
    blocks = numel // record["block_size"]
    return max(d for d in range(1, min(blocks, record["scaler_block_size"]) + 1) if blocks % d == 0)


def nf4_bytes(numel: int, record: dict[str, Any] = NF4_RECORD) -> int:
    """Bytes an NF4 tensor of `numel` values holds, as torchao stores it: two 4-bit codes a byte, an
    int8 scale per 64-value block, a float32 factor per block of scales, their float32 mean and the
    16-level table: ~0.52 bytes a value (0.5 + 1/64 + 4/16384)."""
    blocks = numel // record["block_size"]
    return numel // 2 + blocks + 4 * (blocks // scaler_block_size(numel, record)) + 4 + NF4_LOOKUP_BYTES


def import_nf4() -> Any:
    """torchao's NF4 module: its 0.18 home, else the one it had before (torchao.dtypes.nf4tensor).
    Its import logs a warning for each C++ extension it cannot load (kernels for other formats), and
    compile=on a caching note; none concerns NF4 (core/quiet.py)."""
    with quiet_torchao():
        try:
            return importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
        except ImportError:
            pass
        try:
            return importlib.import_module("torchao.dtypes.nf4tensor")
        except ImportError as err:  # a reader of a QLoRA run on a machine without torchao (training validated it)
            raise UserError(f"a QLoRA run's base weights are stored in 4-bit NF4 through torchao, and torchao's NF4 "
                            f"cannot be imported here ({err}); pip install 'llmtrain[ao]' (or pip install torchao), "
                            "then run this again.") from None


def to_nf4(weight: torch.Tensor, record: dict[str, Any] = NF4_RECORD) -> torch.Tensor:
    """`weight` (a 2-D tensor) as torchao's NF4Tensor, quantized as `record` says."""
    weight = weight.detach().contiguous()
    return import_nf4().to_nf4(weight, record["block_size"], scaler_block_size(weight.numel(), record))


def is_nf4(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "NF4Tensor"  # by name: no torchao import to ask


def store_nf4(model: nn.Module, name: str, weight: torch.Tensor) -> None:
    """`weight` quantized to NF4 as `model`'s weight `name` (a linear layer's), a frozen parameter,
    on the device `weight` is on. A new parameter replaces the one there, whose memory is freed."""
    owner = model.get_submodule(name.rsplit(".", 1)[0])
    owner.weight = nn.Parameter(to_nf4(weight), requires_grad=False)
    if weight.device.type == "cpu":
        _return_freed_heap()


def _return_freed_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc's malloc_trim; nothing elsewhere).
    to_nf4's transients (~40 bytes a value, measured: each value's nearest of the 16 levels) are
    made in torch's worker threads, whose glibc arenas keep them after they are freed and do not
    reuse them for the main thread: measured, quantizing 96 tensors of 768 x 256 one after the other left the
    process 700 MiB larger for 9 MiB of NF4, and 13 MiB larger with a trim after each."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator, its own policy
        pass


def quantize_base(model: nn.Module) -> int:
    """Store the weights `quantized_names` picks of `model` (a GPT, adapters already applied, its
    base frozen) in NF4, in place, those not stored so already (a folder's, quantized as they were
    read: training/setup.py folder_model); each stays a frozen parameter under its name. Returns how
    many are in NF4."""
    names = quantized_names(model.state_dict().keys())
    for name in names:
        weight = model.get_parameter(name)
        if not is_nf4(weight):
            store_nf4(model, name, weight)
    return len(names)


def to_device_but_nf4(model: nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer of `model` to `device`, in place, except the NF4 weights,
    already there (quantized on it as the folder was read). Module.to would hand those to torchao's
    NF4 copy as well, and re-set each parameter's .data, which a tensor subclass need not support.
    A parameter two modules share (a head tied to the embedding) stays one."""
    moved: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in module.named_parameters(recurse=False):
            if not is_nf4(param) and param.device != device:
                if id(param) not in moved:
                    moved[id(param)] = nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
                module._parameters[key] = moved[id(param)]
        for key, buffer in module.named_buffers(recurse=False):
            if buffer.device != device:
                module._buffers[key] = buffer.to(device)


def dequantized_base(state: dict[str, torch.Tensor], record: dict[str, Any] = NF4_RECORD) -> dict[str, torch.Tensor]:
    """A QLoRA run's state (base weights and adapters, llmtrain's names) with each weight the run
    stored in NF4 replaced by its dequantized values in its own dtype: the base the adapters trained
    on, exactly as the run's layers compute with it (torchao dequantizes to the input's dtype; an
    fp32 run's inputs are fp32). Other tensors as they are; a copy."""
    out = dict(state)
    for name in quantized_names(state):
        tensor = state[name]
        nf4 = tensor if is_nf4(tensor) else to_nf4(tensor, record)
        out[name] = nf4.get_original_weight().to(tensor.dtype)
    return out


def nf4_footprint(model: nn.Module) -> tuple[int, int]:
    """(values, bytes) of the NF4 weights a built model holds: each one's inner tensors, measured."""
    values = stored = 0
    for param in {id(p): p for p in model.parameters()}.values():
        if is_nf4(param):
            values += param.numel()
            stored += sum(getattr(param, name).nbytes for name in
                          ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"))
    return values, stored

