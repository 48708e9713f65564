"""Pipeline parallelism (llmtrain/distributed/pipeline.py, pipeline_state.py) against one process: the
split, the stages' names and forward, the merged state dicts and optimizer groups, the window loss,
clipping and the refusals (quick); then 2 gloo processes on CPU for a GPT-2-like and a Llama-like
model under each schedule: 20 AdamW steps with clipping give one process's losses, norms and
weights, evaluation its loss, the state views its state dicts, and a single-process state loaded
into the stages trains on like that process; a tied embedding and head untie without the gradient
sync (slow)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmtrain.config.parallel_limits import pipeline_problems
from llmtrain.config.schema import ActivationCheckpointing, ModelConfig, OptimConfig, PositionEncoding
from llmtrain.data.sampler import IGNORE_INDEX
from llmtrain.distributed.pipeline import (
    COUNTED_ELSEWHERE,
    Pipeline,
    RankModule,
    WindowLoss,
    build_rank_stages,
    build_schedule,
    build_stage_module,
    clip_grad_norm,
    rank_stage_indices,
    run_window,
    stage_layers,
    stage_ranks,
    sync_tied_gradients,
    tied_weight_group,
)
from llmtrain.distributed.pipeline_state import (
    PipelineModelState,
    PipelineOptimizerState,
    global_groups,
    merge_stage_states,
)
from llmtrain.engine.optim import build_optimizer
from llmtrain.engine.precision import NumericPrecision
from llmtrain.engine.step import accumulate_window, count_tokens, evaluate, loss_sum
from llmtrain.engine.timing import StepTimer
from llmtrain.model import GPT
from tests.conftest import assert_optimizer_states_close, gpt_like, llama_like

GPT_LIKE = gpt_like("gpt_pp", n_layer=4)
# its blocks recomputed in backward (activation checkpointing inside a stage)
# op checkpointing on every other block: the stages pick their blocks by the index in the whole model
LLAMA_LIKE = llama_like("llama_pp", n_layer=4, activation_checkpointing=ActivationCheckpointing.op, checkpoint_every=2)
VOCAB = 64
MICRO, SEQ, N_MICRO = 2, 8, 4  # sequences per micro-batch, their length, micro-batches per step
STEPS = 20
LR = 3e-3  # llmtrain's default for this width (tests/test_tensor_parallel.py: 1e-2 is chaotic in one process)
# embeddings not decayed: a tied head's copy on the last stage must land in the embedding's group
OPTIM = OptimConfig(lr=LR, decay_embeddings=False, clip_grad_norm=1.0)
CPU = torch.device("cpu")


# ---- the split (quick) ---------------------------------------------------------------------------------

def test_layers_split_evenly_with_the_extra_ones_first() -> None:
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert stage_layers(3, 1) == [range(0, 3)]
    with pytest.raises(ValueError, match="3 layers cannot be split into 4 stages"):
        stage_layers(3, 4)


def test_stages_are_placed_looped_as_torch_interleaved_schedule_expects() -> None:
    assert stage_ranks(4, 2) == [0, 1, 0, 1]
    assert stage_ranks(2, 2) == [0, 1]
    assert rank_stage_indices(2, 1, "interleaved_1f1b") == [1, 3]
    assert rank_stage_indices(4, 3, "1f1b") == [3]
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        rank_stage_indices(2, 0, "zb")


@pytest.mark.parametrize("cfg", [GPT_LIKE, LLAMA_LIKE], ids=["gpt", "llama"])
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_stages_keep_the_model_names_and_compute_its_forward(cfg: ModelConfig, n_stages: int) -> None:
    torch.manual_seed(0)
    model = GPT(cfg, VOCAB)
    stages = [build_stage_module(model, n_stages, s) for s in range(n_stages)]
    idx = torch.randint(0, VOCAB, (2, SEQ))
    x = idx
    for stage in stages:
        x = stage(x)
    assert torch.equal(x, model(idx))  # the same operations on the same values
    names = {name for stage in stages for name, _ in stage.named_parameters()}
    assert names == {name for name, _ in model.named_parameters()}  # a tied head is the stage's `wte.weight`
    assert [i for stage in stages for i in stage.layers] == list(range(cfg.n_layer))
    assert all(not any(p is q for q in model.parameters()) for stage in stages for p in stage.parameters())  # copies
    last = stages[-1]
    assert hasattr(last, "wte") == (cfg.tie_weights or n_stages == 1)
    assert (hasattr(last, "wte") and last.lm_head.weight is last.wte.weight) == cfg.tie_weights
    copies = [p for stage in stages for p in stage.parameters() if getattr(p, COUNTED_ELSEWHERE, False)]
    assert len(copies) == (cfg.tie_weights and n_stages > 1)
    if n_stages > 2:
        assert not hasattr(stages[1], "wte") and not hasattr(stages[1], "lm_head")
    assert all((s.rope_cos is not None) == (cfg.position is PositionEncoding.rope) for s in stages)


@pytest.mark.parametrize("cfg", [GPT_LIKE, LLAMA_LIKE], ids=["gpt", "llama"])
def test_stages_run_their_forward_in_the_given_autocast(cfg: ModelConfig) -> None:
    """The precision's autocast wraps each stage's forward (the schedule's backward runs outside it)."""
    model = GPT(cfg, VOCAB)
    stages = [build_stage_module(model, 2, s) for s in range(2)]
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    idx = torch.randint(0, VOCAB, (2, SEQ))
    for stage in stages:
        stage.autocast = bf16
    logits = stages[1](stages[0](idx))
    with bf16():
        expected = model(idx)
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, expected)


def test_a_stage_refuses_a_kv_cache() -> None:
    model = GPT(GPT_LIKE, VOCAB)
    with pytest.raises(ValueError, match="cannot generate with a KV cache"):
        build_stage_module(model, 2, 0)(torch.zeros(1, 2, dtype=torch.long), model.new_cache())


@pytest.mark.parametrize("cfg", [GPT_LIKE, LLAMA_LIKE], ids=["gpt", "llama"])
@pytest.mark.parametrize("n_stages", [1, 2, 4])
def test_the_stages_state_dicts_merge_into_the_model_one(cfg: ModelConfig, n_stages: int) -> None:
    model = GPT(cfg, VOCAB)
    stages = [build_stage_module(model, n_stages, s) for s in range(n_stages)]
    merged = merge_stage_states({s.stage_index: s.state_dict() for s in stages}, cfg.tie_weights)
    expected = model.state_dict()
    assert list(merged) == list(expected)
    assert all(torch.equal(merged[k], v) for k, v in expected.items())
    if cfg.tie_weights:  # one tensor under two keys, as GPT's own state dict has it
        assert merged["lm_head.weight"] is merged["wte.weight"]


@pytest.mark.parametrize("decay_embeddings", [False, True])
@pytest.mark.parametrize("cfg", [GPT_LIKE, LLAMA_LIKE], ids=["gpt", "llama"])
@pytest.mark.parametrize(("pp", "schedule"), [(2, "1f1b"), (4, "gpipe"), (2, "interleaved_1f1b")])
def test_the_processes_optimizer_groups_merge_into_the_model_ones(cfg: ModelConfig, pp: int, schedule: str,
                                                                   decay_embeddings: bool) -> None:
    """build_optimizer on each process's stages, merged by name, has the whole model's groups: the
    same parameters in the same order (a tied head's copy in the embedding's group)."""
    optim = OptimConfig(lr=LR, decay_embeddings=decay_embeddings)
    model = GPT(cfg, VOCAB)
    names = {id(p): n for n, p in model.named_parameters()}
    expected = [[names[id(p)] for p in g["params"]] for g in build_optimizer(model, optim, "cpu").param_groups]
    stage_names, group_names = {}, []
    for rank in range(pp):
        stages = build_rank_stages(model, pp, rank, schedule)
        module = RankModule(stages)
        local = {id(p): n for n, p in module.named_parameters()}
        group_names.append([[local[id(p)] for p in g["params"]]
                            for g in build_optimizer(module, optim, "cpu").param_groups])
        stage_names.update({s.stage_index: [n for n, _ in s.named_parameters()] for s in stages})
    assert global_groups(stage_names, group_names) == expected


def test_a_rank_module_merges_its_stages_blocks_in_order() -> None:
    model = GPT(LLAMA_LIKE, VOCAB)
    module = RankModule(build_rank_stages(model, 2, 1, "interleaved_1f1b"))  # stages 1 and 3: layers 1 and 3
    assert list(module.blocks) == ["1", "3"]
    assert [n for n, _ in module.named_parameters()][-1] == "lm_head.weight"
    with pytest.raises(ValueError, match="both the first and the last"):
        RankModule([build_stage_module(model, 2, 0), build_stage_module(model, 2, 1)])


@pytest.mark.parametrize("cfg", [GPT_LIKE, LLAMA_LIKE], ids=["gpt", "llama"])
def test_one_stage_views_are_the_model_and_optimizer_state_dicts(cfg: ModelConfig) -> None:
    """pp=1 needs no process group: the views read and write the one stage."""
    torch.manual_seed(0)
    model = GPT(cfg, VOCAB)
    stage = build_stage_module(model, 1, 0)
    optimizers = [build_optimizer(m, OPTIM, "cpu") for m in (model, RankModule([stage]))]
    idx, targets = torch.randint(0, VOCAB, (2, SEQ)), torch.randint(0, VOCAB, (2, SEQ))
    for m, optimizer in zip((model, stage), optimizers):
        loss_sum(m(idx), targets).backward()
        optimizer.step()
    view = PipelineModelState([stage])
    state = view.state_dict()
    assert list(state) == list(model.state_dict())
    assert_optimizer_states_close(PipelineOptimizerState([stage], optimizers[1]).state_dict(),
                             optimizers[0].state_dict(), atol=0.0)
    fresh = build_stage_module(GPT(cfg, VOCAB), 1, 0)
    fresh_optimizer = build_optimizer(RankModule([fresh]), OPTIM, "cpu")
    PipelineModelState([fresh]).load_state_dict(model.state_dict())
    PipelineOptimizerState([fresh], fresh_optimizer).load_state_dict(optimizers[0].state_dict())
    _assert_state_dicts(PipelineModelState([fresh]).state_dict(), model.state_dict(), atol=0.0)
    assert all(a is not b for a, b in zip(_tensors(fresh_optimizer.state_dict()), _tensors(optimizers[0].state_dict())))


def _tensors(state: dict) -> list[torch.Tensor]:
    return [v for values in state["state"].values() for v in values.values() if isinstance(v, torch.Tensor)]


# ---- loss and clipping (quick) ---------------------------------------------------------------------------

def test_the_window_loss_is_the_loop_loss_sum_over_the_window_tokens() -> None:
    logits, targets = torch.randn(2, 5, VOCAB), torch.randint(0, VOCAB, (2, 5))
    targets[0, :3] = IGNORE_INDEX
    loss = WindowLoss(label_smoothing=0.1)
    loss.n_tokens, loss.scale = 17, 2.0
    torch.testing.assert_close(loss(logits, targets), loss_sum(logits, targets, 0.1) / 17 * 2, atol=0, rtol=0)


def test_clipping_in_one_process_is_torch_clip_grad_norm_and_counts_a_copy_once() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(3)]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, r in zip(params, reference):
        p.grad = torch.randn(p.shape)
        r.grad = p.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.5)
    torch.testing.assert_close(clip_grad_norm(params, 0.5), expected)
    for p, r in zip(params, reference):
        torch.testing.assert_close(p.grad, r.grad)
    copy = torch.nn.Parameter(params[0].detach().clone())  # a tied weight's second copy: not counted again
    copy.grad = params[0].grad.clone()
    setattr(copy, COUNTED_ELSEWHERE, True)
    torch.testing.assert_close(clip_grad_norm([*params, copy], None), torch.nn.utils.get_total_norm(
        [p.grad for p in params]))


# ---- refusals (quick) ---------------------------------------------------------------------------------

def test_a_model_the_pipeline_can_split_has_no_problems() -> None:
    assert pipeline_problems(GPT_LIKE, 2, "1f1b", 2) == []
    assert pipeline_problems(GPT_LIKE, 4, "gpipe", 4) == []
    assert pipeline_problems(GPT_LIKE, 2, "interleaved_1f1b", 4) == []
    assert pipeline_problems(GPT_LIKE, 1, "anything", 1, tp=2, fp16_loss_scaling=True) == []  # no pipeline


def test_fewer_layers_than_stages_are_refused() -> None:
    (problem,) = pipeline_problems(GPT_LIKE, 8, "gpipe", 8)
    assert problem.startswith("model.n_layer is 4, fewer than the 8 pipeline stages of pp=8") and "pp <= 4" in problem
    (problem,) = pipeline_problems(GPT_LIKE, 4, "interleaved_1f1b", 4)
    assert "8 pipeline stages (2 per process under interleaved_1f1b)" in problem
    assert "use pp <= 2, or the gpipe or 1f1b schedule" in problem


def test_too_few_or_uneven_micro_batches_are_refused() -> None:
    (problem,) = pipeline_problems(GPT_LIKE, 4, "1f1b", 3)
    assert problem.startswith("3 micro-batches per optimizer step, fewer than the pp=4 pipeline processes")
    (problem,) = pipeline_problems(GPT_LIKE, 2, "gpipe", 1)
    assert problem.startswith("1 micro-batch per optimizer step")
    (problem,) = pipeline_problems(GPT_LIKE, 2, "interleaved_1f1b", 5)
    assert "in 2 rounds of equal size" in problem and "(e.g. 4 or 6)" in problem
    assert pipeline_problems(GPT_LIKE, 2, "1f1b", 5) == []


def test_an_unknown_schedule_tp_fp16_scaling_and_a_bad_pp_are_refused() -> None:
    assert pipeline_problems(GPT_LIKE, 2, "zero_bubble", 4) == [
        "the pipeline schedule 'zero_bubble' is unknown; use one of gpipe, 1f1b, interleaved_1f1b."]
    problems = pipeline_problems(GPT_LIKE, 2, "gpipe", 4, tp=2, fp16_loss_scaling=True)
    assert [p.split(" (")[0].split(" is")[0] for p in problems] == ["pipeline parallel", "fp16 with loss scaling"]
    assert pipeline_problems(GPT_LIKE, 0, "gpipe", 4)[0].startswith("parallel.pp is 0")


# ---- 2 processes against one (slow) -------------------------------------------------------------------

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("cfg", [GPT_LIKE, LLAMA_LIKE], ids=["gpt", "llama"])
def test_two_processes_train_like_one(tmp_path: Path, cfg: ModelConfig, schedule: str) -> None:
    """Each rank builds the one-process model too and asserts against it (a failing rank ends the job
    and its traceback is raised here)."""
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), _check_training, (cfg, schedule)), nprocs=2, join=True)


@pytest.mark.slow
def test_a_tied_head_unties_without_the_gradient_sync(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), _check_tied_sync, ()), nprocs=2, join=True)


def _worker(rank: int, world: int, store: str, check: Callable[..., None], args: tuple) -> None:
    torch.set_num_threads(1)  # 2 processes on a small machine
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # a guard against a hang, not a measure
    try:
        check(*args)
    finally:
        dist.destroy_process_group()


def _windows() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The same windows on every rank: N_MICRO micro-batches, some targets ignored (the micro-batches
    count different tokens: a per-micro-batch mean would weigh them wrongly); then a window of shorter
    sequences (another shape) and a last window of one micro-batch (fewer than the stages)."""
    g = torch.Generator().manual_seed(7)
    shapes = [(N_MICRO, SEQ)] * (STEPS - 2) + [(N_MICRO, SEQ - 2), (1, SEQ)]
    windows = []
    for n, seq in shapes:
        window = []
        for _ in range(n):
            tokens = torch.randint(0, VOCAB, (MICRO, seq + 1), generator=g)
            x, y = tokens[:, :-1], tokens[:, 1:].clone()
            y[0, : int(torch.randint(0, seq, (), generator=g))] = IGNORE_INDEX
            window.append((x, y))
        windows.append(window)
    return windows


def _single_step(model: GPT, optimizer: torch.optim.Optimizer, window: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The loop's step in one process: accumulate_window, clip_grad_norm_, the update."""
    loss = accumulate_window(model, window, CPU, NumericPrecision(), StepTimer(0, CPU), n_tokens=count_tokens(window))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, norm


def _pipeline_step(pipe: Pipeline, optimizer: torch.optim.Optimizer, window: list) -> tuple[torch.Tensor, torch.Tensor]:
    loss = pipe.forward_backward(window, count_tokens(window))
    norm = pipe.clip_grad_norm(OPTIM.clip_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, norm


def _check_training(cfg: ModelConfig, schedule: str) -> None:
    torch.manual_seed(0)
    single = GPT(cfg, VOCAB)
    pipe = Pipeline(single, schedule)
    view = pipe.model_state()
    loaded = view.state_dict()  # a collective: every rank calls it; rank 0 gets the whole, the other {}
    if dist.get_rank() == 0:
        _assert_state_dicts(loaded, single.state_dict(), atol=0.0)  # exact: the values were only copied
        assert not cfg.tie_weights or loaded["lm_head.weight"] is loaded["wte.weight"]
    else:
        assert loaded == {}

    optimizers = [build_optimizer(single, OPTIM, "cpu"), build_optimizer(pipe.module, OPTIM, "cpu")]
    windows = _windows()
    for window in windows:
        loss, norm = _single_step(single, optimizers[0], window)
        pipe_loss, pipe_norm = _pipeline_step(pipe, optimizers[1], window)
        assert pipe_loss.item() == pytest.approx(loss.item(), abs=1e-5)  # on every rank
        torch.testing.assert_close(pipe_norm, norm, atol=1e-5, rtol=1e-5)  # every stage's, the tied weight once
    eval_batches = [b for window in windows[:2] for b in window]
    assert pipe.evaluate(eval_batches) == pytest.approx(evaluate(single, eval_batches, CPU, contextlib.nullcontext),
                                                        abs=1e-5)

    full, full_optimizer = view.state_dict(), pipe.optimizer_state(optimizers[1]).state_dict()
    if dist.get_rank() == 0:
        # measured: every weight within 1e-5 but the GPT-like q/k/v biases (3e-5): a key bias's gradient is
        # rounding noise that Adam scales up (tests/test_tensor_parallel.py's _assert_state_dicts)
        _assert_state_dicts(full, single.state_dict(), atol=1e-4)
        assert_optimizer_states_close(full_optimizer, optimizers[0].state_dict(), atol=1e-5)
    else:
        assert full == {} and full_optimizer == {}

    # and back: the single process's states loaded into a pipeline from another init, one more step each
    torch.manual_seed(1)
    fresh = Pipeline(GPT(cfg, VOCAB), schedule)
    fresh.model_state().load_state_dict(single.state_dict())
    fresh_optimizer = build_optimizer(fresh.module, OPTIM, "cpu")
    fresh.optimizer_state(fresh_optimizer).load_state_dict(optimizers[0].state_dict())
    for _ in range(2):
        loss, _ = _single_step(single, optimizers[0], windows[0])
        fresh_loss, _ = _pipeline_step(fresh, fresh_optimizer, windows[0])
        assert fresh_loss.item() == pytest.approx(loss.item(), abs=1e-5)
    after = fresh.model_state().state_dict()
    if dist.get_rank() == 0:
        _assert_state_dicts(after, single.state_dict(), atol=1e-4)


def _check_tied_sync() -> None:
    """The functions the Pipeline class is made of, with and without the tied gradients' sum: with it
    the losses are one process's, without it equal at step 1 (the same weights) and apart from step 2
    (the embedding and the head each took half the gradient)."""
    torch.manual_seed(0)
    single = GPT(GPT_LIKE, VOCAB)
    rank = dist.get_rank()
    group = tied_weight_group()
    runs = {}
    for synced in (True, False):
        stages = build_rank_stages(single, 2, rank, "gpipe")
        optimizer = build_optimizer(RankModule(stages), OPTIM, "cpu")
        loss_fn = WindowLoss()
        schedule = build_schedule(stages, N_MICRO, "gpipe", loss_fn)
        losses = []
        for window in _windows()[:3]:
            losses.append(run_window(schedule, stages, window, loss_fn, count_tokens(window)).item())
            if synced:
                sync_tied_gradients(stages, group)
            clip_grad_norm([p for s in stages for p in s.parameters()], OPTIM.clip_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        runs[synced] = losses
    optimizer = build_optimizer(single, OPTIM, "cpu")
    expected = [_single_step(single, optimizer, window)[0].item() for window in _windows()[:3]]
    assert runs[True] == pytest.approx(expected, abs=1e-6)
    assert runs[False][0] == pytest.approx(expected[0], abs=1e-6)
    assert all(abs(a - b) > 1e-4 for a, b in zip(runs[False][1:], expected[1:]))


def _assert_state_dicts(actual: dict, expected: dict, atol: float) -> None:
    """Same keys in the same order, plain tensors, values within `atol`."""
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert type(actual[key]) is torch.Tensor, key
        torch.testing.assert_close(actual[key], value, atol=atol, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
