"""The pre-flight checklist: every item has a config that trips it and one that passes; the CLI's
exit codes; `train` refusing on FAIL; the presets composing and `stable` passing every item."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import llmtrain.preflight.facts as facts
import llmtrain.preflight.items_model as items_model
import llmtrain.preflight.render as render
from llmtrain.cli.compose import compose_config
from llmtrain.config.schema import NormPosition, OptimizerName, Precision, ResidualInit, ScheduleName
from llmtrain.core.findings import Status
from llmtrain.preflight.check import run_check

from .conftest import TINY_CORPUS, run_cli, tiny_config

PRESETS = sorted(p.stem for p in (Path(__file__).parents[1] / "conf" / "preset").glob("*.yaml"))
# A device's fp32 matmul rate for the compute estimate, given rather than measured: a measurement on
# a busy machine reads low (1 GFLOP/s with five jobs on two cores), and no test may turn on it.
LAPTOP_FLOPS = 100e9


def status(cfg, item: str) -> Status:
    return run_check(cfg, measure_compute=False).row(item).status


def base(tmp_path: Path, **overrides):
    """The tiny test config with a 5% warmup of a 100-step run: every item passes."""
    return tiny_config(tmp_path, **{"max_steps": 100, "schedule.warmup_steps": 5, **overrides})


def test_the_base_config_passes_every_item(tmp_path: Path) -> None:
    report = run_check(base(tmp_path), measure_compute=False)
    assert [r.item for r in report.rows if r.status is not Status.PASS] == []
    assert report.exit_code == 0


@pytest.mark.parametrize(
    ("item", "bad", "expected"),
    [
        ("data order", {"data.shuffle": False}, Status.WARN),
        ("data order", {"seed": None}, Status.WARN),
        ("data order", {"data.overfit_batches": 1}, Status.WARN),
        ("warmup", {"schedule.warmup_steps": 0}, Status.WARN),
        ("warmup", {"schedule.warmup_steps": 50}, Status.WARN),  # half the run
        ("gradient clipping", {"optim.clip_grad_norm": None}, Status.WARN),
        ("gradient clipping", {"optim.clip_grad_norm": None, "optim.clip_grad_value": 1.0}, Status.WARN),
        ("gradient clipping", {"optim.clip_grad_norm": 100.0}, Status.WARN),
        ("mixed precision", {"precision.name": Precision.fp16, "precision.loss_scaling": False}, Status.FAIL),
        ("mixed precision", {"precision.name": Precision.bf16}, Status.WARN),  # slower on CPU
        ("train/eval mode", {"model.dropout": 0.5}, Status.WARN),
        ("global seed", {"seed": None}, Status.WARN),
        ("effective batch", {"micro_batch_size": 1, "global_batch_size": 128}, Status.WARN),
        ("learning rate", {"optim.lr": 0.1}, Status.FAIL),
        ("learning rate", {"optim.lr": 1e-6}, Status.WARN),
        ("learning rate", {"optim.name": OptimizerName.sgd, "optim.lr": 3e-5}, Status.WARN),
        ("residual / norm", {"model.norm_position": NormPosition.post, "model.n_layer": 8}, Status.WARN),
        ("init variance", {"model.init_std": 0.5}, Status.WARN),
        ("init variance", {"model.init_std": 1e-4}, Status.WARN),
        ("init variance", {"model.residual_init": ResidualInit.plain, "model.n_layer": 12}, Status.WARN),
        ("token budget", {"max_steps": 20000, "schedule.warmup_steps": 1000}, Status.WARN),  # > 20 epochs
        ("memory", {"model.n_layer": 48, "model.n_embd": 4096, "model.n_head": 32}, Status.FAIL),
    ],
)
def test_item_trips_on_a_bad_config(tmp_path: Path, item: str, bad: dict, expected: Status) -> None:
    row = run_check(base(tmp_path, **bad), measure_compute=False).row(item)
    assert row.status is expected, row
    assert row.fix, "a WARN or FAIL row names the override that fixes it"


@pytest.mark.parametrize(
    ("item", "good"),
    [
        ("learning rate", {"optim.name": OptimizerName.sgd, "optim.lr": 0.05}),
        ("learning rate", {"optim.name": OptimizerName.adafactor, "optim.lr": 1e-3}),
        ("warmup", {"max_steps": 100_000, "schedule.warmup_steps": 600}),  # long run: 0.6% but 600 steps
        ("mixed precision", {"precision.name": Precision.auto}),  # auto -> fp32 on CPU
        ("residual / norm", {"model.norm_position": NormPosition.post, "model.n_layer": 2}),
        ("init variance", {"model.init": "kaiming"}),
    ],
)
def test_item_passes_a_good_variant(tmp_path: Path, item: str, good: dict) -> None:
    assert status(base(tmp_path, **good), item) is Status.PASS


def test_memory_warns_near_the_budget_and_suggests_a_fitting_micro_batch(tmp_path: Path, monkeypatch) -> None:
    cfg = base(tmp_path, **{"micro_batch_size": 64, "global_batch_size": 128, "model.block_size": 256,
                            "model.n_embd": 128, "model.n_head": 4, "model.n_layer": 4})  # activations dominate
    peak = run_check(cfg, measure_compute=False).facts.memory.peak
    runtime = run_check(cfg, measure_compute=False).facts.memory.runtime
    monkeypatch.setattr(facts, "available_memory", lambda device: (peak / 0.9 - runtime, "test budget"))
    assert status(cfg, "memory") is Status.WARN
    monkeypatch.setattr(facts, "available_memory", lambda device: (peak * 0.8 - runtime, "test budget"))
    row = run_check(cfg, measure_compute=False).row("memory")
    assert row.status is Status.FAIL
    assert "micro_batch_size=" in row.fix and "keeps the global batch 128" in row.fix
    assert "(peak " in row.fix and "preset=memory_saver applies the first" in row.fix  # tests/test_memory_savers.py


def test_train_mode_check_catches_an_evaluate_that_leaves_eval_mode(tmp_path: Path, monkeypatch) -> None:
    def broken_evaluate(model, batches, device, autocast):
        model.eval()
        return 0.0

    monkeypatch.setattr(items_model, "evaluate", broken_evaluate)
    row = run_check(base(tmp_path), measure_compute=False).row("train/eval mode")
    assert row.status is Status.FAIL and "left the model in eval mode" in row.seen


def test_check_does_not_move_the_global_rng(tmp_path: Path) -> None:
    import torch

    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    run_check(base(tmp_path), measure_compute=False)
    assert torch.equal(torch.rand(3), expected)


def test_run_time_warns_when_the_run_needs_more_than_a_night(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("llmtrain.preflight.compute.matmul_peak_flops", lambda *args, **kwargs: pytest.fail(
        "a rate given to the check is not measured again"))
    cfg = base(tmp_path, max_steps=10_000, **{"schedule.warmup_steps": 500})
    report = run_check(cfg, matmul_flops=1e6)  # a very slow device
    assert report.row("run time").status is Status.WARN
    assert report.facts.compute.run_seconds > 8 * 3600
    assert run_check(cfg, matmul_flops=LAPTOP_FLOPS).row("run time").status is Status.PASS


# ---------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_with_other_groups(preset: str) -> None:
    cfg = compose_config([f"preset={preset}", "model=modern_tiny", "optim=adamw"])
    assert cfg.model.name in ("modern_tiny", "debug_tiny")


def test_presets_compose_together_and_command_line_wins() -> None:
    cfg = compose_config(["preset=[stable,fast]", "optim.clip_grad_norm=2.0"])
    assert cfg.precision.name is Precision.auto and cfg.optim.fused is True and cfg.optim.clip_grad_norm == 2.0
    assert compose_config(["preset=memory_saver", "micro_batch_size=8"]).micro_batch_size == 8
    assert compose_config(["preset=memory_saver", "memory_saver=false"]).memory_saver is False


def test_stable_preset_passes_every_item() -> None:
    report = run_check(compose_config(["preset=stable"]), matmul_flops=LAPTOP_FLOPS)
    assert [(r.item, r.status.value, r.seen) for r in report.rows if r.status is not Status.PASS] == []
    assert report.row("run time").status is Status.PASS  # the run time row was judged, at a laptop's rate


@pytest.mark.slow  # trains until the loss is near zero
def test_debug_overfit_preset_drives_the_loss_near_zero(tmp_path: Path) -> None:
    """The seed's sanity check on the real model: one repeated batch is memorized."""
    from llmtrain.training.loop import train

    cfg = compose_config(["preset=debug_overfit", "data=text", f"data.path={TINY_CORPUS}", "data.tokenizer=char",
                          f"out_dir={tmp_path / 'run'}", "threads=1"])
    result = train(cfg)
    assert result.train_losses[max(result.train_losses)] < 0.05


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------


def llmtrain(tmp_path: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`llmtrain ARGS` in this process (conftest.run_cli); `timeout` is kept for its callers."""
    return run_cli(*args, cwd=tmp_path, columns=200)


def bad_config_dir(tmp_path: Path) -> Path:
    """A user's own group options that switch the checklist items off."""
    root = tmp_path / "myconf"
    for group in ("schedule", "optim", "precision"):
        (root / group).mkdir(parents=True, exist_ok=True)
    (root / "schedule" / "nowarmup.yaml").write_text("name: cosine\nwarmup_steps: 0\n")
    (root / "optim" / "reckless.yaml").write_text("name: adamw\nlr: 3e-3\nclip_grad_norm: null\n")
    (root / "precision" / "fp16_unscaled.yaml").write_text(
        "# @package _global_\nprecision:\n  name: fp16\n  loss_scaling: false\nseed: null\n")
    return root


BAD = ["schedule=nowarmup", "optim=reckless", "precision=fp16_unscaled"]


def test_cli_bad_config_shows_matching_rows_and_exits_2(tmp_path: Path) -> None:
    proc = llmtrain(tmp_path, "check", "-cd", str(bad_config_dir(tmp_path)), *BAD, "--no-compute")
    assert proc.returncode == 2, proc.stderr
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in proc.stdout.splitlines()
            if line.startswith("│") and line.split("│")[1].strip()}
    assert rows["warmup"] == "WARN" and rows["gradient clipping"] == "WARN"
    assert rows["mixed precision"] == "FAIL" and rows["global seed"] == "WARN"
    fixed = llmtrain(tmp_path, "check", "-cd", str(bad_config_dir(tmp_path)), *BAD, "preset=stable", "--no-compute")
    assert fixed.returncode == 0, fixed.stdout
    fixed_items = {line.split("│")[1].strip() for line in fixed.stdout.splitlines() if line.startswith("│")}
    assert "run time" not in fixed_items and "0 warn, 0 fail -> exit 0" in fixed.stdout  # --no-compute: no run time


@pytest.mark.slow  # gpt_small's check in a fresh process: ~20 s
def test_cli_acceptance_gpt_small_fp16_on_cpu(tmp_path: Path) -> None:
    proc = llmtrain(tmp_path, "check", "model=gpt_small", "optim=adamw", "precision=fp16")
    assert proc.returncode in (1, 2), proc.stderr  # 2 where the host memory is too small for it
    out = proc.stdout
    assert "mixed precision │ WARN" in out.replace("  ", " ") or "WARN │ fp16 on cpu" in out
    assert "precision=fp32" in out  # the fix: fp32 on CPU
    assert "0.0005 (adamw, the default)" in out and "optim.lr=" not in out  # the LR default follows the width
    assert "predicted peak" in out and "GFLOP/s" in out
    assert proc.stdout.strip().endswith(f"-> exit {proc.returncode}")


def test_cli_check_bad_value_is_a_one_paragraph_error(tmp_path: Path) -> None:
    proc = llmtrain(tmp_path, "check", "optim.lr=fast")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "optim.lr" in proc.stderr


def test_train_refuses_a_failing_config_before_making_a_run_dir(tmp_path: Path) -> None:
    args = ["train", "precision=fp16", "precision.loss_scaling=false", "max_steps=2",
            f"hydra.run.dir={tmp_path / 'run'}"]
    proc = llmtrain(tmp_path, *args)
    assert proc.returncode == 2
    assert "pre-flight check failed" in proc.stderr and "allow_check_failures=true" in proc.stderr
    assert "precision.loss_scaling=true" in proc.stderr  # the table with the fix went to stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a fresh process training in fp16 on a CPU: ~14 s
def test_train_with_the_override_runs_and_shows_the_failure_in_the_banner(tmp_path: Path) -> None:
    corpus = ["data=text", f"data.path={TINY_CORPUS}", "data.tokenizer=char", "model.n_layer=1", "model.n_embd=32",
              "model.n_head=2", "model.block_size=32", "micro_batch_size=4", "global_batch_size=4", "eval_interval=0"]
    run = tmp_path / "run"
    proc = llmtrain(tmp_path, "train", *corpus, "max_steps=3", "schedule.warmup_steps=0", "precision=fp16",
                    "precision.loss_scaling=false", "allow_check_failures=true", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr
    assert "fail" in proc.stdout and "mixed precision" in proc.stdout  # FAIL row in the banner
    assert "warmup: none" in proc.stdout  # WARN row in the banner
    start = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert start["check"]["mixed precision"] == "FAIL" and start["check"]["warmup"] == "WARN"


def test_train_eval_check_is_not_fooled_by_a_zero_head(tmp_path: Path) -> None:
    from llmtrain.config.schema import HeadInit

    cfg = base(tmp_path, **{"model.tie_weights": False, "model.head_init": HeadInit.zero,
                            "model.residual_init": ResidualInit.zero})
    assert status(cfg, "train/eval mode") is Status.PASS


def test_fixes_are_overrides_that_work(tmp_path: Path) -> None:
    from llmtrain.config.schema import LRScaling

    scaled = base(tmp_path, **{"schedule.lr_scaling": LRScaling.linear, "schedule.reference_batch_size": 1,
                               "model.n_embd": 128, "model.n_head": 4})
    row = run_check(scaled, measure_compute=False).row("learning rate")  # 3e-3 x 8 = 0.024 for 128 wide
    assert row.status is Status.WARN and row.fix.startswith("optim.lr=")
    scaled.optim.lr = float(row.fix.removeprefix("optim.lr="))  # the suggestion is scaled x8 again ...
    assert status(scaled, "learning rate") is Status.PASS  # ... and lands inside the range
    no_warmup = run_check(base(tmp_path, **{"schedule.warmup_steps": 0}), measure_compute=False)
    assert no_warmup.row("warmup").fix.startswith("schedule.warmup_steps=5")


def test_check_refuses_a_model_vocabulary_smaller_than_the_data(tmp_path: Path) -> None:
    from llmtrain.core.errors import ConfigError
    from llmtrain.data import prepare_data

    cfg = base(tmp_path, **{"model.vocab_size": 8})
    prepare_data(cfg.data, log=lambda message: None)
    with pytest.raises(ConfigError, match="smaller than the data's vocabulary"):
        run_check(cfg, measure_compute=False)


def test_a_schedule_that_ends_before_the_run_warns_right_after_the_warmup_row(tmp_path: Path) -> None:
    report = run_check(base(tmp_path, **{"schedule.total_steps": 60}), measure_compute=False)
    items = [r.item for r in report.rows]
    assert items[items.index("warmup") + 1] == "schedule length"
    row = report.row("schedule length")
    assert row.status is Status.WARN
    assert row.seen == "ends at step 60 of 100: the last 40 steps at the floor LR 0.0003"  # 0.1 x lr 3e-3
    assert row.fix == "schedule.total_steps=null"
    assert report.row("warmup").seen == "5 of the schedule's 60 steps (8.3%)"
    zero = run_check(base(tmp_path, **{"schedule.total_steps": 60, "schedule.min_lr_ratio": 0.0}),
                     measure_compute=False)
    assert zero.row("schedule length").seen == "ends at step 60 of 100: the last 40 steps at LR 0"


@pytest.mark.parametrize("overrides", [
    {"schedule.total_steps": None},
    {"schedule.total_steps": 100},  # exactly the run
    {"schedule.total_steps": 400},  # longer: the run ends mid-decay, by choice
    {"schedule.total_steps": 60, "schedule.name": ScheduleName.constant},  # holds the peak: nothing lost
])
def test_a_schedule_that_covers_the_run_adds_no_row(tmp_path: Path, overrides: dict) -> None:
    report = run_check(base(tmp_path, **overrides), measure_compute=False)
    assert "schedule length" not in [r.item for r in report.rows]
    assert report.exit_code == 0


# ---------------------------------------------------------------------------------------------
# the footer: per-rank memory, depth for the data, parameter counts
# ---------------------------------------------------------------------------------------------


def test_the_per_rank_memory_of_parallel_layouts_shows_only_where_there_are_several_processes(tmp_path: Path) -> None:
    single = run_check(base(tmp_path), measure_compute=False)
    assert single.facts.layout_world is None and "per rank" not in render.estimate_summary(single.facts)
    assert single.row("effective batch").seen.endswith("x 1 process)")
    ddp = run_check(base(tmp_path, **{"parallel.dp_replicate": -1, "parallel.nproc": 2}), measure_compute=False)
    assert "per rank over the run's 2 processes: ddp " in render.estimate_summary(ddp.facts)
    assert ddp.row("effective batch").seen.endswith("x 2 processes)")


def test_several_gpus_on_this_machine_get_the_per_rank_memory_of_a_single_process_config(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert facts.layout_world(base(tmp_path), torch.device("cuda")) == (8, "this machine's 8 GPUs")
    assert facts.layout_world(base(tmp_path), torch.device("cpu")) == (None, "")


@pytest.mark.parametrize("train_tokens", [1_000, 48_000, 1_000_000, 10_655_597, 3_000_000_000])
@pytest.mark.parametrize("layers", [1, 4, 12, 30])
def test_the_depth_line_never_suggests_more_layers_than_the_data_feeds(tmp_path: Path, train_tokens: int,
                                                                       layers: int) -> None:
    import re

    from llmtrain.preflight.estimate import model_shape

    cfg = base(tmp_path, **{"model.n_layer": layers, "model.n_embd": 128, "model.n_head": 4})
    shape = model_shape(cfg, 256)
    fed = train_tokens * facts.DATA_PASSES_WORTH / facts.TOKENS_PER_PARAM / shape.largest_block_params
    line = facts.depth_advice(cfg, shape, train_tokens)
    if line is None:  # nothing to say: the configured depth is one the data feeds, and enough
        assert layers <= fed
        return
    suggested = re.search(r"up to about (\d+) layers", line)
    if suggested:  # deeper: never beyond what the data feeds, nor beyond ~12 layers below a billion tokens
        assert layers < int(suggested.group(1)) <= min(fed, 12 if train_tokens < 1e9 else 24)
    else:  # too deep for the data: says so, with the layers it does feed
        assert layers > fed and f"{layers} configured: more data, or a smaller model" in line
        assert ("less than one layer of width 128" in line) == (fed < 1)


def test_the_depth_line_for_a_small_corpus_says_it_feeds_less_than_a_layer(tmp_path: Path) -> None:
    cfg = compose_config(["data=text", f"data.path={TINY_CORPUS}", "data.tokenizer=char"])  # gpt_tiny on 48K tokens
    summary = render.estimate_summary(run_check(cfg, measure_compute=False).facts)
    assert "layers is enough" not in summary
    assert "less than one layer of width 128 (198,272 parameters), 4 configured" in summary


def test_every_parameter_count_is_labelled_and_the_same_in_every_row(tmp_path: Path) -> None:
    from llmtrain.model import GPT, param_count

    cfg = compose_config([])  # gpt_tiny: tied head, learned positions
    report = run_check(cfg, matmul_flops=LAPTOP_FLOPS)
    counts = report.facts.parameters
    built = GPT(cfg.model, report.facts.vocab_size)
    assert (counts.total, counts.without_positions) == (param_count(built), param_count(built, exclude_positions=True))
    assert counts.text() == "858,880 total, 826,112 without the position table, 793,344 without embeddings"
    assert "for 793,344 parameters without embeddings = " in report.row("token budget").seen
    assert "/ 793,344 parameters without embeddings = " in render.estimate_summary(report.facts)
    rope = run_check(compose_config(["model=modern_tiny"]), measure_compute=False).facts.parameters
    assert rope.total == rope.without_positions and "position table" not in rope.text()


def test_an_lr_too_high_for_a_small_batch_warns_and_its_fix_passes(tmp_path: Path) -> None:
    from llmtrain.config.derived import batch_scaled_lr, run_default_lr

    small = base(tmp_path, **{"global_batch_size": 2, "micro_batch_size": 2, "data.seq_len": 64,
                              "model.block_size": 64})
    small.optim.lr = run_default_lr(small)  # the default LR, set for batches of ~4,096 tokens
    row = run_check(small, measure_compute=False).row("learning rate")
    assert row.status is Status.WARN and "128 tokens per step" in row.seen, row
    assert float(row.fix.removeprefix("optim.lr=")) == pytest.approx(batch_scaled_lr(small.optim.lr, 128), rel=0.1)
    small.optim.lr = float(row.fix.removeprefix("optim.lr="))
    assert status(small, "learning rate") is Status.PASS
    larger = base(tmp_path, **{"global_batch_size": 8, "micro_batch_size": 8, "data.seq_len": 64,
                               "model.block_size": 64})
    larger.optim.lr = run_default_lr(larger)  # 512 tokens at the default: 2.8x the root-scaled LR, fine
    assert status(larger, "learning rate") is Status.PASS


def test_sgd_without_momentum_warns(tmp_path: Path) -> None:
    plain = base(tmp_path, **{"optim.name": OptimizerName.sgd, "optim.lr": 0.05, "optim.momentum": 0.0})
    row = run_check(plain, measure_compute=False).row("momentum")
    assert row.status is Status.WARN and row.fix == "optim.momentum=0.9"
    plain.optim.momentum = 0.9
    assert status(plain, "momentum") is Status.PASS
    assert "momentum" not in [r.item for r in run_check(base(tmp_path), measure_compute=False).rows]  # AdamW: no row
