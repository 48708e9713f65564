"""`llmtrain doctor`: every experiment passes on the real model and catches a deliberately broken one.

The broken models below exist only here; each carries one classic bug that the experiment it is
handed to must find (and name)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch.utils.checkpoint import checkpoint

from llmtrain.config.schema import ActivationCheckpointing, DataSource, ModelConfig, PositionEncoding
from llmtrain.core.errors import UserError
from llmtrain.doctor import (
    EXPERIMENTS,
    probe_targets,
    run_doctor,
    run_eval_consistency,
    run_grad_check,
    run_lr_range,
    run_overfit,
)
from llmtrain.model import GPT
from tests.conftest import TINY_CORPUS, run_cli, tiny_config

# The best peak LR of tiny_config among 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1 (AdamW, 200 steps, warmup 10,
# cosine): val loss 3.26, 2.78, 2.50, 2.68, 2.80, 3.04. conftest trains it with 3e-3 too.
KNOWN_GOOD_TINY_LR = 3e-3


def quiet_console() -> tuple[Console, io.StringIO]:
    """A console whose plain-text output the test can read."""
    buffer = io.StringIO()
    return Console(file=buffer, width=200, force_terminal=False, color_system=None), buffer


# ---- broken models ---------------------------------------------------------------------------


class InputBlindGPT(GPT):
    """The forward never looks at the tokens (it feeds zeros): only positions reach the output."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.zeros_like(idx))


def _bidirectional_attention(self, x: torch.Tensor, rope: object = None, cache: object = None,
                             start: int = 0) -> torch.Tensor:
    B, T, C = x.shape
    q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=False)  # the bug: no causal mask
    return self.proj(y.transpose(1, 2).reshape(B, T, C))


def leaky_gpt(cfg: ModelConfig, vocab_size: int) -> GPT:
    """Attention sees the future: memorizing is trivial, and the overfit check must not be fooled."""
    model = GPT(cfg, vocab_size)
    for block in model.blocks:
        block.attn.forward = types.MethodType(_bidirectional_attention, block.attn)
    return model


class CheckpointDropsRopeGPT(GPT):
    """Under activation checkpointing the blocks are called without the RoPE tables: an argument lost
    on the way through checkpoint(), so the checkpointed path computes something else."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx))
        rope = (self.rope_cos, self.rope_sin)
        for block in self.blocks:
            if self.cfg.activation_checkpointing is not ActivationCheckpointing.none and self.training:
                x = checkpoint(block, x, None, use_reentrant=False)
            else:
                x = block(x, rope)
        return self.lm_head(self.norm_f(x))


class EvalDropoutGPT(GPT):
    """Dropout that ignores the mode: still active in eval mode."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.dropout(super().forward(idx), self.cfg.dropout, training=True)


# ---- overfit ---------------------------------------------------------------------------------


def test_overfit_passes_on_the_real_model(tmp_path: Path) -> None:
    console, out = quiet_console()
    result = run_overfit(tiny_config(tmp_path / "run"), tmp_path / "doctor", console)
    text = out.getvalue()
    assert result.passed, text
    assert result.losses[-1] < 0.1 <= result.losses[0] and result.steps_to_target == len(result.losses)
    assert result.causal and "PASS" in text
    saved = json.loads((tmp_path / "doctor" / "overfit.json").read_text())
    assert saved["passed"] and saved["losses"] == pytest.approx(result.losses)
    assert (tmp_path / "doctor" / "overfit.png").stat().st_size > 0


def test_overfit_fails_on_a_model_that_ignores_its_input(tmp_path: Path) -> None:
    console, out = quiet_console()
    result = run_overfit(tiny_config(tmp_path / "run"), tmp_path / "doctor", console, build_model=InputBlindGPT,
                         max_steps=150)
    text = out.getvalue()
    assert not result.passed and result.steps_to_target is None
    assert "code bug, not a hyper-parameter" in text
    assert any("does not depend on the input tokens" in s for s in result.suspects), result.suspects
    assert result.probes["causality"]["uses_input"] is False
    assert json.loads((tmp_path / "doctor" / "overfit.json").read_text())["passed"] is False


def test_overfit_is_not_fooled_by_a_future_leak(tmp_path: Path) -> None:
    """A non-causal model memorizes easily; the verdict is still FAIL, naming the leak."""
    console, out = quiet_console()
    result = run_overfit(tiny_config(tmp_path / "run"), tmp_path / "doctor", console, build_model=leaky_gpt)
    assert not result.passed and not result.causal
    assert result.probes["causality"]["max_change_before"] > 0
    assert any("future tokens leak" in s for s in result.suspects), result.suspects
    assert "code bug, not a hyper-parameter" in out.getvalue()


# ---- lr-range --------------------------------------------------------------------------------


def test_lr_range_suggests_a_known_good_lr(tmp_path: Path) -> None:
    console, out = quiet_console()
    result = run_lr_range(tiny_config(tmp_path / "run"), tmp_path / "doctor", console)
    assert result.passed, out.getvalue()
    assert KNOWN_GOOD_TINY_LR / 10 <= result.suggested_lr <= KNOWN_GOOD_TINY_LR * 10, result.suggested_lr
    assert result.lrs == sorted(result.lrs) and result.lrs[0] == pytest.approx(1e-6)
    assert "suggested peak LR" in out.getvalue() and "optim.lr = 0.003" in out.getvalue()
    saved = json.loads((tmp_path / "doctor" / "lr-range.json").read_text())
    assert saved["suggested_lr"] == pytest.approx(result.suggested_lr)
    assert (tmp_path / "doctor" / "lr-range.png").stat().st_size > 0


def test_lr_range_fails_a_config_lr_past_divergence(tmp_path: Path) -> None:
    """Without clipping the tiny model diverges inside the sweep; an optim.lr beyond that point is a problem."""
    cfg = tiny_config(tmp_path / "run", **{"optim.lr": 5.0, "optim.clip_grad_norm": None})
    console, out = quiet_console()
    result = run_lr_range(cfg, tmp_path / "doctor", console, max_lr=10.0)
    assert result.diverged_lr is not None and result.diverged_lr <= 5.0
    assert not result.passed and any("diverged" in note for note in result.notes), out.getvalue()


# ---- grad-check ------------------------------------------------------------------------------


def test_grad_check_passes_on_the_real_model(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path / "run", **{"model.dropout": 0.1})  # checkpointing must replay dropout's RNG
    console, out = quiet_console()
    result = run_grad_check(cfg, tmp_path / "doctor", console)
    assert result.passed, out.getvalue()
    names = [c.name for c in result.checks]
    assert names[:3] == ["activation checkpointing full = none", "activation checkpointing op = none",
                         "fp32 ~ bf16 autocast"]
    assert any("2 x 4" in n for n in names) and any("8 x 1" in n for n in names)  # the config's split and singles
    full, op = result.checks[0].details, result.checks[1].details
    assert full["gradients"]["rel_diff"] <= 1e-5 and op["gradients"]["rel_diff"] <= 1e-5
    # full keeps only the blocks' inputs, op their matmul and attention outputs too: less than none either way
    assert full["activation_bytes"][1] < op["activation_bytes"][1] < op["activation_bytes"][0]
    assert "saved)" in out.getvalue()
    assert result.checks[2].details["gradients"]["cosine"] > 0.99
    assert json.loads((tmp_path / "doctor" / "grad-check.json").read_text())["passed"]


def test_grad_check_catches_a_checkpointed_path_that_differs(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path / "run", **{"model.position": PositionEncoding.rope})
    console, out = quiet_console()
    result = run_grad_check(cfg, tmp_path / "doctor", console, build_model=CheckpointDropsRopeGPT)
    checks = {c.name: c for c in result.checks}
    assert not result.passed
    broken = ("activation checkpointing full = none", "activation checkpointing op = none")  # it ignores the mode
    assert all(not checks[name].passed for name in broken)
    assert checks[broken[0]].details["gradients"]["rel_diff"] > 10 * 1e-5
    assert all(c.passed for name, c in checks.items() if name not in broken)
    assert "activation checkpointing full = none failed" in out.getvalue()
    assert run_doctor("grad-check", cfg, tmp_path / "doctor", quiet_console()[0],
                      build_model=CheckpointDropsRopeGPT) == 1


def test_grad_check_catches_a_per_micro_batch_mean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A train loop that averages each micro-batch's loss and forgets the window: the gradient is
    (number of micro-batches) times too large, which the single-sequence split shows."""
    import llmtrain.doctor.bench as bench_module  # where the experiments look it up

    def mean_per_micro_batch(model, batches, device, precision, timer, label_smoothing=0.0, **_):
        total = torch.zeros(())
        for x, y in batches:
            loss = F.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten())
            loss.backward()
            total += loss.detach()
        return total

    monkeypatch.setattr(bench_module, "accumulate_window", mean_per_micro_batch)
    console, _ = quiet_console()
    result = run_grad_check(tiny_config(tmp_path / "run"), tmp_path / "doctor", console)
    accumulation = [c for c in result.checks if c.name.startswith("accumulated")]
    assert not result.passed and all(not c.passed for c in accumulation)
    assert accumulation[-1].details["gradients"]["norm_ratio"] == pytest.approx(8.0, rel=1e-3)


def _mean_over_micro_batches(model, batches, device, precision, timer, label_smoothing=0.0, **_):
    """The classic accumulation bug: each micro-batch's MEAN loss divided by the number of micro-batches.
    Right only when every micro-batch holds as many real tokens as the others."""
    total = torch.zeros(())
    for x, y in batches:
        loss = F.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten(), ignore_index=-100)
        (loss / len(batches)).backward()
        total += loss.detach() / len(batches)
    return total


def test_grad_check_catches_mean_over_micro_batches_on_masked_data(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Invisible on plain text (equal token counts), caught on instruction data, whose prompt tokens
    are masked out of the loss, so micro-batches differ in real tokens."""
    import random

    import llmtrain.doctor.bench as bench_module  # where the experiments look it up

    rng = random.Random(0)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "response": f"{a + b};" * rng.randint(1, 5)}) + "\n"
                             for a, b in ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(200))))
    instruct = {"data.source": DataSource.instruct, "data.path": str(pairs)}
    assert run_grad_check(tiny_config(tmp_path / "a", **instruct), tmp_path / "a", quiet_console()[0]).passed

    monkeypatch.setattr(bench_module, "accumulate_window", _mean_over_micro_batches)
    plain = run_grad_check(tiny_config(tmp_path / "b"), tmp_path / "b", quiet_console()[0])
    assert plain.passed, "on equal token counts the bug gives the right gradient"
    masked = run_grad_check(tiny_config(tmp_path / "c", **instruct), tmp_path / "c", quiet_console()[0])
    failed = [c.name for c in masked.checks if not c.passed]
    assert not masked.passed and failed and all(name.startswith("accumulated") for name in failed)


def test_target_probe() -> None:
    x = torch.tensor([[5, 6, 7, 8, 9]])
    assert probe_targets(x, torch.tensor([[6, 7, 8, 9, 10]]))["suspects"] == []
    assert probe_targets(x, x.clone())["targets_equal_inputs"]
    assert not probe_targets(x, torch.tensor([[7, 8, 9, 10, 11]]))["targets_shifted_by_one"]
    # An instruction row: prompt targets masked, the last real target has padding (0) after it in x.
    padded_x, padded_y = torch.tensor([[5, 6, 7, 0, 0]]), torch.tensor([[-100, 7, 8, -100, -100]])
    assert probe_targets(padded_x, padded_y)["suspects"] == []


# ---- eval-consistency ------------------------------------------------------------------------


def test_eval_consistency_passes_on_the_real_model(tmp_path: Path) -> None:
    console, out = quiet_console()
    result = run_eval_consistency(tiny_config(tmp_path / "run"), tmp_path / "doctor", console)
    assert result.passed, out.getvalue()
    assert result.dropout == 0.1  # forced: the tiny config has none
    assert "(forced: the config has none)" in out.getvalue()
    assert len(result.checks) == 4
    assert json.loads((tmp_path / "doctor" / "eval-consistency.json").read_text())["passed"]


def test_eval_consistency_catches_dropout_in_eval_mode(tmp_path: Path) -> None:
    console, out = quiet_console()
    result = run_eval_consistency(tiny_config(tmp_path / "run", **{"model.dropout": 0.2}), tmp_path / "doctor",
                                  console, build_model=EvalDropoutGPT)
    verdicts = {c.name: c.passed for c in result.checks}
    assert not result.passed and result.dropout == 0.2
    assert verdicts["eval mode twice: identical logits"] is False
    assert verdicts["eval mode (dropout 0.2) = train mode, dropout 0"] is False
    assert verdicts["train mode, dropout 0.2: random"] is True
    assert "eval mode twice: identical logits failed" in out.getvalue()


# ---- dispatch and CLI ------------------------------------------------------------------------


def test_experiments_and_unknown_name(tmp_path: Path) -> None:
    assert list(EXPERIMENTS) == ["overfit", "lr-range", "grad-check", "eval-consistency"]
    with pytest.raises(UserError, match="valid experiments: overfit, lr-range, grad-check, eval-consistency"):
        run_doctor("overfitt", tiny_config(tmp_path / "run"), tmp_path / "doctor", quiet_console()[0])


TINY_OVERRIDES = [
    "data=text", f"data.path={TINY_CORPUS}", "data.tokenizer=char", "data.val_fraction=0.1", "model.n_layer=2",
    "model.n_head=2", "model.n_embd=32", "model.block_size=32", "micro_batch_size=4", "global_batch_size=8",
    "device=cpu", "threads=1",
]


def test_cli_overfit_writes_a_png_and_exits_0(tmp_path: Path) -> None:
    import matplotlib.image

    out = tmp_path / "doctor"
    proc = run_cli("doctor", "overfit", *TINY_OVERRIDES, "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout and "Traceback" not in proc.stderr
    image = matplotlib.image.imread(out / "overfit.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert json.loads((out / "overfit.json").read_text())["passed"] is True


def test_cli_user_mistake_is_one_paragraph(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "file.txt"
    not_a_folder.write_text("x")
    proc = run_cli("doctor", "grad-check", *TINY_OVERRIDES, "--out", str(not_a_folder), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("llmtrain: error: --out is") and "not a folder" in proc.stderr


def test_importing_doctor_does_not_import_torch() -> None:
    """`llmtrain doctor --help` imports EXPERIMENTS: it must stay instant."""
    code = "import sys, llmtrain.doctor; print('torch' in sys.modules, 'numpy' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["False", "False"], proc.stdout + proc.stderr
