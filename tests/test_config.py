"""The config layer: every shipped group option composes and builds; derived quantities; round-trips.

Composition goes through Hydra's compose API on the shipped `conf/` (the same files the CLI uses),
then `to_config`, then the object each group configures (model, optimizer, schedule, precision).
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from llmtrain.cli.common import conf_dir
from llmtrain.config.derived import (
    accumulation_steps,
    default_lr,
    model_vocab_size,
    resolved_warmup_steps,
    seq_len_of,
    total_micro_batches,
    total_steps,
)
from llmtrain.config.hydra import config_from_dict, register_configs, to_config
from llmtrain.config.schema import (
    GROUPS,
    CheckpointFormat,
    Config,
    DataConfig,
    DataSource,
    ModelConfig,
    MonitorAction,
    NonFinitePolicy,
    NormPosition,
    OptimizerName,
    Precision,
    ScheduleConfig,
    ScheduleName,
    config_to_dict,
    field_type,
)
from llmtrain.config.validate import validate
from llmtrain.core.errors import ConfigError
from llmtrain.data import prepare_data
from llmtrain.engine.optim import build_optimizer
from llmtrain.engine.precision import autocast_factory, build_grad_scaler
from llmtrain.engine.schedule import lr_at
from llmtrain.model import GPT

CONF = conf_dir()
GROUP_OPTIONS = [(group, path.stem) for group in GROUPS for path in sorted((CONF / group).glob("*.yaml"))]
TINY_MODEL = ModelConfig(name="t", n_layer=1, n_head=2, n_embd=16, block_size=16)


def compose_config(overrides: list[str]) -> object:
    """The composed OmegaConf node for `overrides`, exactly as the CLI composes it."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="test"):
        return compose(config_name="config", overrides=overrides)


PRESET_PROCESSES = {"tp": 2, "hsdp": 4, "fsdp_tp": 4, "pp": 2, "fsdp_pp": 4}


def load_option(group: str, option: str, tmp_path: Path) -> Config:
    overrides = [f"{group}={option}"]
    if group == "data" and option == "text":
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("a tiny corpus, for composing the text data option.\n" * 50, encoding="utf-8")
        overrides.append(f"data.path={corpus}")
    if group == "data" and option == "hf":
        overrides.append("data.hf_name=json")  # a builder: composes without the datasets package or a download
    if group == "parallel" and option in PRESET_PROCESSES:  # layouts that need several processes to be valid
        overrides.append(f"parallel.nproc={PRESET_PROCESSES[option]}")
    if group == "data" and option in ("jsonl", "instruct", "hf"):
        corpus = tmp_path / "docs.jsonl"
        line = '{{"text": "document {i} of a tiny corpus.", "prompt": "Say {i}.", "response": "{i}, a tiny answer."}}\n'
        corpus.write_text("".join(line.format(i=i) for i in range(40)), encoding="utf-8")
        overrides.append(f"data.path={corpus}")
    if group == "finetune" and option == "qlora":  # QLoRA quantizes a trained base: it needs a folder
        from .test_hf_init import save_llama

        overrides.append(f"model.init_from={save_llama(tmp_path / 'llama')}")
    return to_config(compose_config(overrides))


def tiny_batch(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------------------------------
# (a) every shipped option composes, converts and builds
# ---------------------------------------------------------------------------------------------


def test_group_folders_match_schema_groups() -> None:
    on_disk = sorted(p.name for p in CONF.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    # presets set keys across groups (no schema node of their own); hydra/ holds launcher and sweeper options
    assert on_disk == sorted([*GROUPS, "preset", "hydra"])
    for group in GROUPS:
        assert any(g == group for g, _ in GROUP_OPTIONS), f"group {group} has no options"


def test_default_config_composes_to_the_schema_defaults() -> None:
    cfg = to_config(compose_config([]))
    expected = Config()
    validate(expected)  # fills in what null means (optim.lr, micro_batch_size), as to_config does
    assert cfg == expected, "config.yaml's defaults drifted from the dataclass defaults"


# Seconds to build (hundreds of MB of weights): the quick tier builds the others of the group.
BIG_MODELS = {("model", "gpt2_medium"), ("model", "smollm_135m")}


@pytest.mark.parametrize(("group", "option"), [
    pytest.param(g, o, id=f"{g}={o}", marks=[pytest.mark.slow] if (g, o) in BIG_MODELS else [])
    for g, o in GROUP_OPTIONS])
def test_option_composes_converts_and_builds(group: str, option: str, tmp_path: Path) -> None:
    cfg = load_option(group, option, tmp_path)
    section = getattr(cfg, group)
    # The option file's values arrived in the typed section (the file names its own option).
    raw = yaml.safe_load((CONF / group / f"{option}.yaml").read_text())
    for key, value in raw.items():
        if group == "data" and key in ("path", "hf_name") and option in ("text", "jsonl", "instruct", "hf"):
            continue  # required, so the test set it
        if group == "parallel" and key == "nproc" and option in PRESET_PROCESSES:
            continue  # set by the test, so the layout validates
        got = getattr(section, key)
        got = got.value if hasattr(got, "value") else got
        if group == "optim" and key == "lr" and value is None:  # null: validate filled in the default
            assert got == default_lr(cfg.optim.name, cfg.model.n_embd), f"optim.lr: {got!r}"
            continue
        assert got == value, f"{group}.{key}: {got!r} != {value!r}"

    if group == "model":
        vocab = cfg.model.vocab_size or 256
        model = GPT(cfg.model, vocab_size=vocab)
        with torch.no_grad():
            logits = model(tiny_batch(vocab))
        assert logits.shape == (1, 8, vocab)
        assert torch.isfinite(logits).all()
    elif group == "optim":
        model = GPT(TINY_MODEL, vocab_size=32)
        optimizer = build_optimizer(model, cfg.optim, "cpu")
        assert type(optimizer).__name__.lower() == cfg.optim.name.value
        assert all(g["lr"] == cfg.optim.lr for g in optimizer.param_groups)
        before = [p.detach().clone() for p in model.parameters()]
        model(tiny_batch(32)).logsumexp(-1).mean().backward()
        optimizer.step()
        changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
        assert any(changed), "one optimizer step changed no parameter"
        assert all(torch.isfinite(p).all() for p in model.parameters())
    elif group == "schedule":
        total = total_steps(cfg)
        warmup = resolved_warmup_steps(cfg.schedule, total)
        lrs = [lr_at(step, cfg.optim.lr, total, cfg.schedule) for step in range(total)]
        assert all(0 < lr <= cfg.optim.lr * (1 + 1e-12) for lr in lrs)
        assert lrs[0] == pytest.approx(cfg.optim.lr / warmup if warmup else cfg.optim.lr)
        assert max(lrs) == pytest.approx(cfg.optim.lr)
        if cfg.schedule.name is ScheduleName.constant:
            assert lrs[-1] == pytest.approx(cfg.optim.lr)
        else:
            assert lrs[-1] == pytest.approx(cfg.optim.lr * cfg.schedule.min_lr_ratio)
    elif group == "precision":
        autocast = autocast_factory(cfg.precision, "cpu")
        scaler = build_grad_scaler(cfg.precision, "cpu")
        assert (scaler is not None) == (cfg.precision.name is Precision.fp16)
        model = GPT(TINY_MODEL, vocab_size=32)
        with autocast():
            logits = model(tiny_batch(32))
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 32), tiny_batch(32).reshape(-1))
        expected_dtype = {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16,
                          Precision.auto: torch.float32}  # auto is fp32 on CPU
        assert logits.dtype == expected_dtype[cfg.precision.name]
        (scaler.scale(loss) if scaler is not None else loss).backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
        if scaler is not None:
            assert scaler.get_scale() == cfg.precision.init_scale
    elif group == "data":
        assert cfg.data.source is DataSource(option)
        if cfg.data.source is not DataSource.python_stdlib:  # the embedded stdlib corpus is too big to prepare here
            data = prepare_data(dataclasses.replace(cfg.data, cache_dir=str(tmp_path / "cache")), log=lambda _: None)
            assert data.vocab_size == 256
            assert data.meta["train_tokens"] > 0 and data.meta["val_tokens"] > 0
    elif group == "checkpoint":
        policy = cfg.checkpoint
        assert policy.keep_last >= 1 and policy.final
        if option == "none":
            assert policy.every_steps is None and policy.every_minutes is None
            assert policy.on_nonfinite is NonFinitePolicy.stop
        else:
            assert policy.every_steps and policy.on_nonfinite is NonFinitePolicy.skip
    elif group == "monitor":
        from llmtrain.monitor.detectors import Detectors

        assert cfg.monitor.enabled == (option != "off")
        monitor = Detectors(cfg.monitor)
        assert monitor.action_for("loss_spike") in set(MonitorAction)
    elif group == "eval":
        from llmtrain.config.eval_tasks import parse_task_specs

        assert cfg.eval.tasks == [] and parse_task_specs(cfg.eval.tasks) == []
        assert cfg.eval.batch_size >= 1 and cfg.eval.truncate
    elif group == "finetune":
        from llmtrain.lora import apply_lora

        model = GPT(TINY_MODEL, vocab_size=32)
        if option in ("lora", "qlora"):
            assert apply_lora(model, cfg.finetune) > 0
            assert cfg.optim.lr == 2e-4  # the adapters' default LR, not the width's
            assert (type(model.blocks[0].mlp.up.weight).__name__ == "NF4Tensor") == (option == "qlora")
        assert any(p.requires_grad for p in model.parameters())
    else:
        assert group == "parallel"
        p = cfg.parallel
        shape = {"single": (1, 1, 1, False), "ddp": (-1, 1, 1, False), "zero1": (-1, 1, 1, True),
                 "fsdp": (1, -1, 1, False), "hsdp": (2, -1, 1, False), "tp": (1, 1, 2, False),
                 "fsdp_tp": (1, -1, 2, False), "pp": (1, 1, 1, False), "fsdp_pp": (1, -1, 1, False)}[option]
        assert (p.dp_replicate, p.dp_shard, p.tp, p.zero1) == shape


def test_gpt_small_is_the_gpt2_124m_shape() -> None:
    cfg = to_config(compose_config(["model=gpt_small"]))
    model = GPT(cfg.model, vocab_size=model_vocab_size(cfg, 50257))  # GPT-2's tokenizer: padded to 50304
    unique = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert 123e6 < unique < 126e6


# ---------------------------------------------------------------------------------------------
# (b) derived quantities
# ---------------------------------------------------------------------------------------------


def make(**kw: object) -> Config:
    """A Config with top-level overrides; model/data kept small so seq_len is explicit."""
    cfg = Config(model=ModelConfig(block_size=64), data=DataConfig(seq_len=kw.pop("seq_len", 8)))  # type: ignore[arg-type]
    for key, value in kw.items():
        setattr(cfg, key, value)
    return cfg


def test_default_sub_configs_are_not_shared_between_instances() -> None:
    a, b = Config(), Config()
    for group in GROUPS:
        assert getattr(a, group) is not getattr(b, group), f"Config().{group} is shared between instances"


def test_defaults_derived_quantities() -> None:
    cfg = Config()
    validate(cfg)
    assert accumulation_steps(cfg) == 1  # 16 / 16
    assert total_micro_batches(cfg) == 1000
    assert total_steps(cfg) == 1000
    assert seq_len_of(cfg) == cfg.model.block_size == 256


@pytest.mark.parametrize(
    ("micro", "global_", "world", "accum"),
    [(16, 32, 1, 2), (16, 32, 2, 1), (4, 48, 1, 12), (4, 48, 3, 4), (8, 8, 1, 1)],
)
def test_accumulation_steps(micro: int, global_: int, world: int, accum: int) -> None:
    cfg = make(micro_batch_size=micro, global_batch_size=global_, max_steps=10)
    validate(cfg, world_size=world)
    assert accumulation_steps(cfg, world) == accum
    assert total_micro_batches(cfg, world) == 10 * accum
    assert total_steps(cfg, world) == 10


@pytest.mark.parametrize(
    ("max_tokens", "micro_batches", "steps"),
    [
        # micro 4 x seq_len 8 = 32 tokens per micro-batch, accumulation 4 (global 16)
        (1, 1, 1),  # less than one micro-batch: still one (partial) step
        (32, 1, 1),
        (4 * 32, 4, 1),  # exactly one full window
        (4 * 32 + 1, 5, 2),  # one token into the next micro-batch: a partial second window
        (6 * 32, 6, 2),  # ends mid-window: steps of 4 and 2 micro-batches
        (9 * 32 - 5, 9, 3),
        (12 * 32, 12, 3),
    ],
)
def test_max_tokens_ending_mid_window(max_tokens: int, micro_batches: int, steps: int) -> None:
    cfg = make(micro_batch_size=4, global_batch_size=16, max_tokens=max_tokens, max_steps=600)
    validate(cfg)
    assert accumulation_steps(cfg) == 4
    assert total_micro_batches(cfg) == micro_batches, "max_tokens rounds up to whole micro-batches"
    assert total_steps(cfg) == steps, "max_tokens wins over max_steps; a partial last window is a step"


def test_max_tokens_with_world_size() -> None:
    # micro 4 x world 2 x seq_len 8 = 64 tokens per micro-batch round; accumulation 16 / 8 = 2
    cfg = make(micro_batch_size=4, global_batch_size=16, max_tokens=5 * 64, max_steps=None)
    validate(cfg, world_size=2)
    assert accumulation_steps(cfg, 2) == 2
    assert total_micro_batches(cfg, 2) == 5
    assert total_steps(cfg, 2) == 3


def test_max_tokens_uses_block_size_when_seq_len_is_null() -> None:
    cfg = Config(max_tokens=10 * 16 * 256 + 1, max_steps=None, global_batch_size=32)
    validate(cfg)
    assert total_micro_batches(cfg) == 11
    assert total_steps(cfg) == 6  # accumulation 2: five full windows and a final one of 1


def test_global_batch_must_divide_by_micro_times_world() -> None:
    cfg = make(micro_batch_size=16, global_batch_size=48)
    validate(cfg)  # 48 = 3 x 16
    with pytest.raises(ConfigError, match=r"'global_batch_size' \(48\).*16 x 2 = 32.*multiples of 32"):
        validate(cfg, world_size=2)


def test_warmup_is_checked_against_the_max_tokens_run_length() -> None:
    cfg = make(micro_batch_size=4, global_batch_size=16, max_tokens=6 * 32)  # 2 steps
    cfg.schedule = ScheduleConfig(warmup_steps=1)
    validate(cfg)
    cfg.schedule = ScheduleConfig(warmup_steps=2)
    with pytest.raises(ConfigError, match=r"Warmup \(2 steps.*the run \(2 steps\)"):
        validate(cfg)


def test_neither_max_steps_nor_max_tokens() -> None:
    with pytest.raises(ConfigError, match="Neither 'max_steps' nor 'max_tokens'"):
        validate(make(max_steps=None, max_tokens=None))


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"micro_batch_size": 0}, "'micro_batch_size' is 0"),
        ({"max_steps": 0}, "'max_steps' is 0"),
        ({"max_tokens": 0}, "'max_tokens' is 0"),
        ({"eval_interval": -1}, "'eval_interval' is -1"),
        ({"device": "tpu"}, "'device' is 'tpu'"),
    ],
)
def test_validate_rejects_bad_top_level_values(changes: dict, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        validate(make(**changes))


def layout(nproc: int = 1, **degrees: object) -> Config:
    cfg = make()
    cfg.parallel.nproc = nproc
    for key, value in degrees.items():
        setattr(cfg.parallel, key, value)
    return cfg


@pytest.mark.parametrize(("nproc", "degrees", "message"), [
    (2, {}, r"this run has 2 processes \(parallel.nproc=2\) but the layout is a single process.*add parallel=ddp"),
    (1, {"tp": 2}, r"the layout tp=2 x dp_replicate=1 x dp_shard=1 needs 2 processes but this run has 1 process.*"
                   r"add parallel.nproc=2"),
    (3, {"tp": 2, "dp_shard": -1}, r"this run has 3 processes.*fixed degrees.*do not divide.*parallel.nproc=4"),
    (4, {"dp_replicate": -1, "dp_shard": -1}, r"both -1"),
    (2, {"dp_shard": 0}, r"'parallel.dp_shard' is 0; use a process count >= 1, or -1"),
    (2, {"tp": -1}, r"'parallel.tp' is -1"),
    (4, {"dp_replicate": 2, "tp": 2}, r"tensor parallel \(tp=2\) with dp_replicate=2 replicas is not supported.*"
                                      r"parallel=fsdp_tp"),
    (2, {"dp_shard": -1, "zero1": True}, r"parallel.zero1 splits the optimizer state across replicas"),
    (1, {"sequence_parallel": True}, r"sequence_parallel.*tp is 1"),
    (8, {"tp": 8}, r"tensor parallel \(tp=8\) cannot split this run: model.n_head is 4, which tp=8 does not "
                   r"divide.*\(1, 2, 4\)"),
    (2, {"pp": 2}, r"pipeline parallel \(pp=2\) cannot run this config: 1 micro-batch per optimizer step, fewer than"),
    (8, {"pp": 8, "pp_microbatches": 8}, r"pipeline parallel \(pp=8\) cannot run this config: model.n_layer is 4, "
                                         r"fewer than the 8"),
    (4, {"pp": 2, "dp_replicate": -1}, r"pipeline parallel \(pp=2\) with dp_replicate=2 DDP replicas \(dp_shard=1\) "
                                       r"is not built.*parallel=fsdp_pp parallel.pp=2 parallel.nproc=4"),
    (4, {"pp": 2, "tp": 2, "pp_microbatches": 4}, r"pipeline parallel \(pp=2\) with tensor parallel \(tp=2\) is not "
                                                  r"supported"),
    (2, {"pp": 2, "pp_schedule": "zigzag"}, r"'parallel.pp_schedule' is 'zigzag'; valid schedules: gpipe, 1f1b, "
                                            r"interleaved_1f1b"),
    (2, {"pp": 2, "pp_microbatches": 3}, r"pp_microbatches=3 does not divide each data-parallel rank's batch of 16"),
    (2, {"pp": 0}, r"'parallel.pp' is 0"),
])
def test_impossible_layouts_are_refused_in_one_paragraph(nproc: int, degrees: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        validate(layout(nproc, **degrees))
    assert "\n" not in str(err.value)


def test_a_pipeline_takes_fsdp2_and_hsdp_for_its_data_parallel_dimension() -> None:
    from llmtrain.config.derived import accumulation_steps, degrees_of

    cfg = layout(4, pp=2, dp_shard=-1, pp_microbatches=2)
    validate(cfg)  # 2 stages x 2 shards: each shard's 8 sequences in 2 micro-batches of 4
    assert degrees_of(cfg, 4).dp_shard == 2 and cfg.micro_batch_size == 4 and accumulation_steps(cfg, 2) == 2
    validate(layout(8, pp=2, dp_replicate=2, dp_shard=-1, pp_microbatches=2))  # HSDP stages
    sharded = layout(4, pp=2, dp_shard=-1, pp_microbatches=2)
    sharded.checkpoint.format = CheckpointFormat.sharded
    with pytest.raises(ConfigError, match=r"checkpoint.format is sharded but pipeline parallel \(pp=2\) writes"):
        validate(sharded)


def test_degrees_fill_in_the_rest_and_split_the_batch_over_the_data_parallel_ranks() -> None:
    from llmtrain.config.derived import accumulation_steps, degrees_of

    cfg = layout(4, dp_shard=-1, tp=2)
    validate(cfg)
    degrees = degrees_of(cfg)
    assert (degrees.dp_replicate, degrees.dp_shard, degrees.tp, degrees.dp, degrees.world) == (1, 2, 2, 2, 4)
    from llmtrain.distributed.layout import Layout

    # the tp ranks of one data rank read one batch; so do the stages of one pipeline
    assert [Layout(rank=r, world_size=4, tp=2).dp_rank for r in range(4)] == [0, 0, 1, 1]
    assert [Layout(rank=r, world_size=4, pp=2).dp_rank for r in range(4)] == [0, 1, 0, 1]
    assert Layout(rank=5, world_size=8, tp=2, pp=2).dp_size == 2
    # The global batch of 16 over 2 data-parallel ranks: 8 each, not 4 (the tp ranks read the same)
    assert cfg.micro_batch_size == 8 and accumulation_steps(cfg) == 1
    hsdp = layout(8, dp_replicate=2, dp_shard=-1)
    validate(hsdp)
    assert degrees_of(hsdp).dp_shard == 4


def test_pipeline_microbatches_set_the_micro_batch() -> None:
    from llmtrain.config.derived import accumulation_steps

    cfg = layout(2, pp=2, pp_microbatches=4)
    validate(cfg)
    assert cfg.micro_batch_size == 4 and accumulation_steps(cfg) == 4  # the global 16, one data-parallel rank
    clash = layout(2, pp=2, pp_microbatches=4)
    clash.micro_batch_size = 8
    with pytest.raises(ConfigError, match="pp_microbatches=4 means micro-batches of 4 sequences, but "
                                          "micro_batch_size is 8"):
        validate(clash)


def test_the_old_parallel_mode_key_on_the_command_line_names_the_presets() -> None:
    from llmtrain.config.hydra import unknown_key_message

    message = unknown_key_message("parallel.mode")
    assert "replaced by the mesh degrees" in message and "parallel=single|ddp|zero1|fsdp" in message


def test_a_saved_config_with_the_old_parallel_mode_reads_as_its_preset() -> None:
    from llmtrain.config.hydra import config_from_dict
    from llmtrain.config.schema import config_to_dict

    for mode, expected in [("single", (1, 1, False)), ("ddp", (-1, 1, False)), ("zero1", (-1, 1, True)),
                           ("fsdp", (1, -1, False))]:
        data = config_to_dict(Config())
        data["parallel"] = {"mode": mode, "nproc": 1}
        p = config_from_dict(data).parallel
        assert (p.dp_replicate, p.dp_shard, p.zero1) == expected


def test_sharded_checkpoint_files_need_a_sharded_model() -> None:
    cfg = make()
    cfg.checkpoint.format = CheckpointFormat.sharded
    with pytest.raises(ConfigError, match="checkpoint.format is sharded but the layout is tp=1 x dp_replicate=1 x "
                       "dp_shard=1.*parallel=fsdp"):
        validate(cfg)
    cfg.parallel.dp_shard = -1
    validate(cfg)


# ---------------------------------------------------------------------------------------------
# (c) config_to_dict / config_from_dict
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model=modern_tiny", "optim=sgd", "schedule=wsd", "precision=fp16"],
        ["model=gpt_small", "optim=adafactor", "schedule=linear", "precision=bf16"],
        [
            "optim=adam",
            "schedule=constant",
            "schedule.warmup_steps=3",
            "max_tokens=100000",
            "max_steps=null",
            "optim.clip_grad_norm=null",
            "optim.clip_grad_value=0.5",
            "data.seq_len=128",
            "out_dir=runs/x",
        ],
    ],
    ids=["defaults", "modern", "small", "misc"],
)
def test_config_dict_round_trip(overrides: list[str]) -> None:
    cfg = to_config(compose_config(overrides))
    plain = config_to_dict(cfg)
    # Plain Python only (enums as their values), so it can be written as YAML ...
    dumped = yaml.safe_dump(plain, sort_keys=False)
    assert plain["model"]["norm_position"] == cfg.model.norm_position.value
    assert type(plain["model"]["norm_position"]) is str
    # ... and read back into an equal Config, directly and through the YAML text.
    assert config_from_dict(plain) == cfg
    assert config_from_dict(yaml.safe_load(dumped)) == cfg
    assert config_to_dict(config_from_dict(plain)) == plain


def test_config_from_dict_restores_enums_and_validates() -> None:
    plain = config_to_dict(Config())
    plain["model"]["norm_position"] = "post"
    plain["optim"]["name"] = "sgd"
    cfg = config_from_dict(plain)
    assert cfg.model.norm_position is NormPosition.post
    assert cfg.optim.name is OptimizerName.sgd
    plain["optim"]["lr"] = -1.0
    with pytest.raises(ConfigError, match="'optim.lr' is -1.0"):
        config_from_dict(plain)


def test_config_from_dict_partial_dict_takes_schema_defaults() -> None:
    cfg = config_from_dict({"max_steps": 7, "model": {"n_layer": 2}})
    assert cfg.max_steps == 7 and cfg.model.n_layer == 2
    assert cfg.model.n_embd == ModelConfig().n_embd
    assert cfg.schedule.name is ScheduleName.cosine


# ---------------------------------------------------------------------------------------------
# (d) unknown keys (`+key=value`) and OmegaConf errors become ConfigError
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "pieces"),
    [
        ({"model": {"foo": 2}}, ["'model.foo'", "Valid keys under 'model'", "n_layer"]),
        ({"model": {"n_layr": 2}}, ["'model.n_layr'", "Did you mean 'model.n_layer'?"]),
        ({"foo": 1}, ["'foo'", "at the top level"]),
        ({"n_layer": 4}, ["'n_layer'", "Did you mean 'model.n_layer'?"]),
        ({"lr": 0.1}, ["'lr'", "Did you mean 'optim.lr'?"]),
        ({"n_head": 4}, ["'n_head'", "Did you mean 'model.n_head'?"]),
        ({"warmup_steps": 5}, ["Did you mean 'schedule.warmup_steps'?"]),
        ({"optim": {"lr": 1e-3, "betas": [0.9, 0.99]}}, ["'optim.betas'", "Valid keys under 'optim'"]),
    ],
)
def test_to_config_refuses_extra_keys(data: dict, pieces: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        to_config(OmegaConf.create(data))
    message = str(info.value)
    assert message.startswith("Unknown config key")
    for piece in pieces:
        assert piece in message, f"{piece!r} not in {message}"


def test_plus_key_composes_but_to_config_refuses_it() -> None:
    node = compose_config(["+model.foo=2"])  # Hydra adds the key; the schema check must catch it
    assert OmegaConf.select(node, "model.foo") == 2
    with pytest.raises(ConfigError, match=r"Unknown config key 'model\.foo'"):
        to_config(node)


@pytest.mark.parametrize(
    ("data", "pieces"),
    [
        ({"precision": {"name": "fp8"}}, ["'precision.name'", "fp8", "fp32", "bf16", "fp16"]),
        ({"model": {"n_layer": "abc"}}, ["'model.n_layer' is 'abc'", "expected an integer"]),
        ({"max_steps": "many"}, ["'max_steps'", "many", "int"]),
    ],
)
def test_to_config_wrong_types_and_enums(data: dict, pieces: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        to_config(OmegaConf.create(data))
    for piece in pieces:
        assert piece in str(info.value), f"{piece!r} not in {info.value}"


@pytest.mark.parametrize(
    "tp",
    [
        pytest.param(typing.Optional[int], id="typing.Optional"),  # noqa: UP007, UP045
        pytest.param(int | None, id="pep604"),
        pytest.param(int, id="plain"),
    ],
)
def test_field_type_unwraps_optional(tp: object) -> None:
    assert field_type(tp) is int


def test_wrong_type_for_optional_field_names_the_concrete_type() -> None:
    with pytest.raises(ConfigError) as info:
        to_config(OmegaConf.create({"max_steps": "many"}))
    assert "expected an integer (a whole number) or null" in str(info.value), str(info.value)


def test_to_config_returns_plain_dataclasses() -> None:
    cfg = to_config(compose_config(["optim=sgd"]))
    assert type(cfg) is Config
    assert cfg.optim.name is OptimizerName.sgd
    assert isinstance(cfg.optim.lr, float) and math.isclose(cfg.optim.lr, 0.1)
    assert not any(type(v).__module__.startswith("omegaconf") for v in vars(cfg).values())


@pytest.mark.parametrize(
    ("key", "value", "piece"),
    [
        ("optim.momentum", -0.5, "'optim.momentum' is -0.5"),
        ("optim.lr", float("inf"), "finite"),
        ("model.mlp_ratio", -1.0, "'model.mlp_ratio'"),
        ("seed", -1, "'seed' is -1"),
        ("data.seed", 2**32, "'data.seed'"),
        ("precision.init_scale", 0.0, "'precision.init_scale'"),
        ("precision.growth_interval", 0, "'precision.growth_interval'"),
        ("device", "cudax", "valid: auto, cpu, cuda, cuda:N, mps"),
    ],
)
def test_values_torch_or_numpy_would_reject_fail_validation_first(key: str, value: object, piece: str) -> None:
    cfg = Config()
    target = cfg
    *parents, leaf = key.split(".")
    for part in parents:
        target = getattr(target, part)
    setattr(target, leaf, value)
    with pytest.raises(ConfigError, match=re.escape(piece)):
        validate(cfg)


@pytest.mark.parametrize("overrides, message", [
    (["data.seq_len=0", "max_tokens=10000"], "'data.seq_len' is 0; it must be >= 1."),
    (["data.seq_len_schedule=[[0,16],[10,0]]", "max_tokens=10000"], "every length must be in 1..model.block_size"),
])
def test_a_zero_length_with_a_token_budget_is_refused_not_divided_by(overrides: list[str], message: str) -> None:
    """A token budget is turned into steps by dividing by the sequence length: a zero length once
    ended in ZeroDivisionError instead of this message."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        to_config(compose_config(overrides))


# ---------------------------------------------------------------------------------------------
# schedule.total_steps: the LR schedule's own length
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "schedule").glob("*.yaml")))
def test_every_schedule_option_defaults_to_the_runs_length(option: str) -> None:
    raw = yaml.safe_load((CONF / "schedule" / f"{option}.yaml").read_text())
    assert "total_steps" in raw and raw["total_steps"] is None


@pytest.mark.parametrize("value", [0, -3])
def test_schedule_total_steps_must_be_positive_or_null(value: int) -> None:
    cfg = make(max_steps=100)
    cfg.schedule.total_steps = value
    with pytest.raises(ConfigError, match=rf"^'schedule.total_steps' is {value}; use the schedule's length in "
                                          r"optimizer steps \(>= 1\), or null for the run's length\.$"):
        validate(cfg)


def test_a_schedule_longer_than_the_run_is_allowed_and_warmup_is_checked_against_it() -> None:
    cfg = make(max_steps=100)
    cfg.schedule = ScheduleConfig(total_steps=400, warmup_steps=150)  # a run cut into pieces: warmup spans two
    validate(cfg)
    cfg.schedule = ScheduleConfig(total_steps=50, warmup_steps=50)
    with pytest.raises(ConfigError, match=r"^Warmup \(50 steps, from schedule.warmup_steps=50\) is not shorter than "
                                          r"the schedule \(schedule.total_steps=50\); use schedule.warmup_steps<50, .*"
                                          r"or a longer schedule.total_steps\.$"):
        validate(cfg)
    cfg.schedule = ScheduleConfig(total_steps=50, warmup_steps=49)
    validate(cfg)
