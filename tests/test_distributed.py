"""parallel=ddp on CPU with gloo, 2 processes (4 for the 2-D layouts): the same training as one
process, one run dir under torchrun, resume across world sizes, and a crashed rank ending the job
at once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import TINY_CORPUS, run_cli

RUN = [
    "data=text", f"data.path={TINY_CORPUS}", "data.tokenizer=char", "model.n_layer=2", "model.n_embd=32",
    "model.n_head=2", "model.block_size=32", "model.dropout=0.0", "micro_batch_size=2", "global_batch_size=8",
    "max_steps=6", "schedule.warmup_steps=1", "eval_interval=3", "log_interval=1", "checkpoint.every_steps=1",
    "monitor.interval=2", "monitor.activation_interval=2",  # the health checks (collectives under fsdp) run too
    # not auto: the free cores it measures, so the thread count and the sums, would follow
    # the machine's load
    "threads=1",
]
DDP = ["parallel=ddp", "parallel.nproc=2"]

pytestmark = pytest.mark.slow


def llmtrain(cwd: Path, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`llmtrain train RUN ARGS` (conftest.run_cli): a run of one process in this one, no new
    interpreter; one with ranks (parallel.nproc > 1) in a subprocess, whose output holds theirs.
    `timeout` guards against a hang, it does not measure speed."""
    return run_cli("train", *RUN, *args, cwd=cwd, env=env, columns=200, timeout=timeout)


def losses(run_dir: Path) -> dict[int, float]:
    """Train loss by step; a step taken twice (before a stop and after the resume) keeps the last."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}


def val_losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["val_loss"] for r in map(json.loads, lines) if r["kind"] == "eval"}


def assert_close(a: dict[int, float], b: dict[int, float], rel: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    assert all(b[k] == pytest.approx(a[k], rel=rel) for k in a), (a, b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run in one process."""
    tmp = tmp_path_factory.mktemp("single")
    proc = llmtrain(tmp, f"hydra.run.dir={tmp / 'run'}")
    assert proc.returncode == 0, proc.stderr
    return tmp / "run"


@pytest.mark.parametrize(("mode", "banner"), [("ddp", "DDP over gloo"), ("zero1", "DDP + ZeRO-1 optimizer shards"),
                                            ("fsdp", "FSDP2 (parameters, gradients and optimizer state sharded)"),
                                            ("tp", "tensor parallel 2 over gloo"),
                                            ("pp", "pipeline parallel 2 (1f1b) over gloo")])
def test_two_processes_train_like_one(tmp_path: Path, reference: Path, mode: str, banner: str) -> None:
    proc = llmtrain(tmp_path, f"parallel={mode}", "parallel.nproc=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    assert f"world size 2, {banner}" in proc.stdout
    assert_close(losses(reference), losses(tmp_path / "run"))
    assert_close(val_losses(reference), val_losses(tmp_path / "run"))
    single, ddp = (torch.load(d / "model.pt", weights_only=True) for d in (reference, tmp_path / "run"))
    assert all(torch.allclose(single[k], ddp[k], atol=1e-5) for k in single)
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"kind": "train"' in line for line in records) == 6, "rank 0 alone writes the records"
    if mode in ("fsdp", "tp", "pp"):  # split while training; the weights and the export are whole
        exported = run_cli("export", str(tmp_path / "run"), cwd=tmp_path)
        assert exported.returncode == 0, exported.stderr
        assert (tmp_path / "run" / "export" / "model.safetensors").is_file()


def test_torchrun_ranks_agree_on_one_run_dir(tmp_path: Path, reference: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--nproc_per_node=2", "-m", "llmtrain", "train", *RUN, "parallel=ddp"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run_dirs = list((tmp_path / "outputs").glob("*/*"))
    assert len(run_dirs) == 1, run_dirs  # each rank runs Hydra; without agreement each took its own timestamp
    assert_close(losses(reference), losses(run_dirs[0]))


ZERO1 = ["parallel=zero1", "parallel.nproc=2"]
FSDP = ["parallel=fsdp", "parallel.nproc=2"]
FSDP_FULL_FILES = [*FSDP, "checkpoint.format=full"]
FSDP_4 = ["parallel=fsdp", "parallel.nproc=4"]  # 2 x 4 = the global batch of 8: no accumulation
HSDP_4 = ["parallel=hsdp", "parallel.nproc=4"]  # 2 replicas x 2 shards (FSDP2 on a 2-D mesh)
TP = ["parallel=tp", "parallel.nproc=2"]  # both ranks read the same batch of 8: no data parallelism
FSDP_TP_4 = ["parallel=fsdp_tp", "parallel.nproc=4"]  # 2 shards x tp 2, with sequence parallel
PP = ["parallel=pp", "parallel.nproc=2"]  # 2 stages; the window's 4 micro-batches flow through them (1f1b)
# 2 stages x 2 FSDP2 shards: each shard's 4 sequences of the batch of 8 in 2 micro-batches of 2
FSDP_PP_4 = ["parallel=fsdp_pp", "parallel.nproc=4", "parallel.pp_microbatches=2"]


def assert_layouts_train_like_one_process(tmp_path: Path, model: list[str], layouts: dict[str, list[str]]) -> None:
    """`model` trained for 20 steps in one process and under each of `layouts`: the same train and
    validation losses (1e-5 relative) and final weights (1e-4), under the same names."""
    twenty = ["max_steps=20", "eval_interval=10", "checkpoint.every_steps=10", *model]
    reference = tmp_path / "single"
    proc = llmtrain(tmp_path, *twenty, f"hydra.run.dir={reference}")
    assert proc.returncode == 0, proc.stderr
    single = torch.load(reference / "model.pt", weights_only=True)
    assert max(losses(reference)) == 20
    for name, extra in layouts.items():
        proc = llmtrain(tmp_path, *twenty, *extra, f"hydra.run.dir={tmp_path / name}")
        assert proc.returncode == 0, proc.stderr
        assert_close(losses(reference), losses(tmp_path / name))
        assert_close(val_losses(reference), val_losses(tmp_path / name))
        split = torch.load(tmp_path / name / "model.pt", weights_only=True)
        assert single.keys() == split.keys()
        # 20 steps of AdamW divide by sqrt(v): the sums' rounding orders (per-shard, per-stage) grow to
        # ~1e-5 in the weights where the losses still agree to 1e-5 (measured: at most 1.2e-5, tp)
        worst = max((single[k] - split[k]).abs().max().item() for k in single)
        assert worst <= 1e-4, f"{name}: weights differ by up to {worst:.2e}"


def test_a_gpt_model_trains_under_every_model_parallel_layout_like_one_process(tmp_path: Path) -> None:
    """GPT-2 style (LayerNorm with biases, learned positions, a head tied to the embedding) over 4
    blocks: tensor parallel, each pipeline schedule, and FSDP2 x tensor / pipeline parallel."""
    assert_layouts_train_like_one_process(
        tmp_path, ["model.n_layer=4", "model.n_head=4"],
        {"tp": TP, "gpipe": [*PP, "parallel.pp_schedule=gpipe"], "1f1b": PP,
         "interleaved": [*PP, "parallel.pp_schedule=interleaved_1f1b"], "fsdp_tp": FSDP_TP_4, "fsdp_pp": FSDP_PP_4})


def test_clipping_by_value_under_split_layouts_clips_like_one_process(tmp_path: Path) -> None:
    """optim.clip_grad_value clamps each gradient element: tensor-parallel shards, pipeline stages
    and FSDP2 shards of a stage clamp their own elements, as one process clamps all of them."""
    assert_layouts_train_like_one_process(
        tmp_path, ["model.n_layer=4", "optim.clip_grad_norm=null", "optim.clip_grad_value=0.01"],
        {"tp": TP, "fsdp_pp": FSDP_PP_4})


def test_a_llama_family_model_trains_under_tensor_parallel_like_one_process(tmp_path: Path) -> None:
    """Grouped-query attention (4 query heads sharing 2 key/value heads, 1 of each per rank), RoPE,
    RMSNorm, SwiGLU, an untied head; the vocabulary padded to a multiple of tp."""
    assert_layouts_train_like_one_process(
        tmp_path, ["model=llama_tiny", "model.n_layer=2", "model.vocab_multiple=2", "model.block_size=32"],
        {"tp": TP, "tp_sp": [*TP, "parallel.sequence_parallel=true"]})


def test_a_llama_family_model_trains_on_two_dimensional_meshes_like_one_process(tmp_path: Path) -> None:
    """FSDP2 x tensor parallel (with sequence parallel) and FSDP2 x pipeline (4 layers in 2 stages,
    the untied head on the last), 4 processes each, against one process."""
    assert_layouts_train_like_one_process(
        tmp_path, ["model=llama_tiny", "model.n_layer=4", "model.vocab_multiple=2", "model.block_size=32"],
        {"fsdp_tp": FSDP_TP_4, "fsdp_pp": FSDP_PP_4})


def test_every_pipeline_schedule_trains_a_llama_family_model_like_one_process(tmp_path: Path) -> None:
    """4 layers over 2 stages (interleaved: 4 stages, 2 per process, placed round-robin); the
    window's 4 micro-batches run through the schedule; the untied head on the last stage."""
    assert_layouts_train_like_one_process(
        tmp_path, ["model=llama_tiny", "model.n_layer=4", "model.block_size=32"],
        {"gpipe": [*PP, "parallel.pp_schedule=gpipe"], "1f1b": PP,
         "interleaved": [*PP, "parallel.pp_schedule=interleaved_1f1b"]})


def test_a_pipeline_of_fsdp2_sharded_stages_trains_like_one_process(tmp_path: Path, reference: Path) -> None:
    """The tied embedding and head on the first and last stage, each stage sharded over 2 processes:
    the same losses, weights and (in the single-process format, on rank 0) optimizer state."""
    proc = llmtrain(tmp_path, *FSDP_PP_4, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    assert ("world size 4, FSDP2 (parameters, gradients and optimizer state sharded) x pipeline parallel 2 (1f1b)"
            in proc.stdout)
    assert_close(losses(reference), losses(tmp_path / "run"))
    assert_close(val_losses(reference), val_losses(tmp_path / "run"))
    single, split = (torch.load(d / "model.pt", weights_only=True) for d in (reference, tmp_path / "run"))
    assert list(single) == list(split) and all(torch.allclose(single[k], split[k], atol=1e-5) for k in single)
    one, four = (torch.load(d / "checkpoints" / "step_00000006" / "optimizer.pt", weights_only=True)["optimizer"]
                 for d in (reference, tmp_path / "run"))
    assert [g["params"] for g in one["param_groups"]] == [g["params"] for g in four["param_groups"]]
    assert one["state"].keys() == four["state"].keys()
    for index, values in one["state"].items():
        for key, value in values.items():
            assert value.shape == four["state"][index][key].shape
            assert (value - four["state"][index][key]).abs().max() <= 1e-5 * value.abs().max(), (index, key)


@pytest.fixture(scope="module")
def stopped_at_3(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], Path]:
    """Runs stopped after step 3 that several resumes start from (each resume works on a copy):
    by the command that made them. Others are made by the test that needs them."""
    made = {}
    for first in (["parallel=single"], FSDP):
        tmp = tmp_path_factory.mktemp("stopped")
        stopped = llmtrain(tmp, *first, f"hydra.run.dir={tmp / 'run'}", env={"LLMTRAIN_TEST_STOP_AT_STEP": "3"})
        assert stopped.returncode == 75, stopped.stderr
        made[tuple(first)] = tmp / "run"
    return made


@pytest.mark.parametrize(("first", "then"), [(DDP, ["parallel=single"]), (["parallel=single"], DDP),
                                             (ZERO1, ["parallel=single"]), (["parallel=single"], ZERO1),
                                             (FSDP, ["parallel=single"]), (["parallel=single"], FSDP),
                                             (FSDP, FSDP_4), (FSDP_FULL_FILES, ["parallel=single"]),
                                             (HSDP_4, ["parallel=single"]), (TP, ["parallel=single"]),
                                             (["parallel=single"], TP), (FSDP_TP_4, ["parallel=single"]),
                                             (PP, ["parallel=single"]), (["parallel=single"], PP),
                                             (FSDP_PP_4, ["parallel=single"]), (["parallel=single"], FSDP_PP_4)],
                         ids=["ddp-2-to-1", "ddp-1-to-2", "zero1-2-to-1", "zero1-1-to-2", "fsdp-2-to-1", "fsdp-1-to-2",
                              "fsdp-sharded-files-2-to-4", "fsdp-full-files-2-to-1", "hsdp-4-to-1", "tp-2-to-1",
                              "tp-1-to-2", "fsdp-tp-4-to-1", "pp-2-to-1", "pp-1-to-2", "fsdp-pp-4-to-1",
                              "fsdp-pp-1-to-4"])
def test_a_run_resumes_on_another_world_size(tmp_path: Path, reference: Path, stopped_at_3: dict, first: list,
                                             then: list) -> None:
    run = tmp_path / "run"
    if tuple(first) in stopped_at_3:
        shutil.copytree(stopped_at_3[tuple(first)], run)
    else:
        stopped = llmtrain(tmp_path, *first, f"hydra.run.dir={run}", env={"LLMTRAIN_TEST_STOP_AT_STEP": "3"})
        assert stopped.returncode == 75, stopped.stderr
    saved = run / "checkpoints" / "step_00000003"
    sharded_files = first in (FSDP, HSDP_4)  # checkpoint.format=auto: every rank writes its own shards under FSDP2
    assert (saved / "shards" / "__1_0.distcp").is_file() == sharded_files
    assert (saved / "model.pt").is_file() != sharded_files
    resumed = llmtrain(tmp_path, *then, f"hydra.run.dir={run}")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at step 3" in resumed.stdout
    assert_close(losses(reference), losses(run))


def test_a_crashed_rank_ends_the_job_at_once_and_the_run_resumes(tmp_path: Path, reference: Path) -> None:
    run = tmp_path / "run"
    # At once: the launcher stops the other rank rather than leave it waiting for its dead peer in
    # a collective (gloo's timeout is 30 minutes); the timeout only turns such a hang into a failure.
    crashed = llmtrain(tmp_path, *DDP, f"hydra.run.dir={run}", env={"LLMTRAIN_TEST_CRASH_RANK_AT": "1:4"}, timeout=120)
    assert crashed.returncode == 1, crashed.stderr
    assert "rank 1 of 2 failed" in crashed.stderr and "test crash of rank 1 at step 4" in crashed.stderr
    assert max(losses(run)) == 3
    resumed = llmtrain(tmp_path, *DDP, f"hydra.run.dir={run}")
    assert resumed.returncode == 0, resumed.stderr
    assert_close(losses(reference), losses(run))


@pytest.fixture(scope="module")
def single_with_nan_at_3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("nan")
    single = llmtrain(tmp, f"hydra.run.dir={tmp / 'single'}", env={"LLMTRAIN_TEST_NAN_AT_STEPS": "3"})
    assert single.returncode == 0, single.stderr
    return tmp / "single"


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_non_finite_step_is_skipped_on_every_rank_as_in_one_process(tmp_path: Path, single_with_nan_at_3: Path,
                                                                      mode: str) -> None:
    nan = {"LLMTRAIN_TEST_NAN_AT_STEPS": "3"}
    ranks = llmtrain(tmp_path, f"parallel={mode}", "parallel.nproc=2", f"hydra.run.dir={tmp_path / 'ranks'}", env=nan)
    assert ranks.returncode == 0, ranks.stderr
    assert 3 not in losses(tmp_path / "ranks"), "step 3 was skipped, not logged as a train step"
    assert_close(losses(single_with_nan_at_3), losses(tmp_path / "ranks"))


def test_a_rollback_under_fsdp_reads_its_sharded_checkpoint_as_one_process_would(tmp_path: Path) -> None:
    nan, rollback = (
        {"LLMTRAIN_TEST_NAN_AT_STEPS": "5"},
        ["checkpoint.on_nonfinite=rollback", "checkpoint.every_steps=2"],
    )
    single = llmtrain(tmp_path, *rollback, f"hydra.run.dir={tmp_path / 'single'}", env=nan)
    ranks = llmtrain(tmp_path, *FSDP, *rollback, f"hydra.run.dir={tmp_path / 'ranks'}", env=nan)
    assert single.returncode == 0 and ranks.returncode == 0, ranks.stderr
    assert (tmp_path / "ranks" / "checkpoints" / "step_00000004" / "shards").is_dir()
    records = [json.loads(line) for line in (tmp_path / "ranks" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["to_step"]) for r in records if r["kind"] == "rollback"] == [(5, 4)]
    assert_close(losses(tmp_path / "single"), losses(tmp_path / "ranks"))


def test_epoch_sampling_resumes_on_another_world_size(tmp_path: Path) -> None:
    epochs = ["data.sampling=epoch", "data.max_bytes=1200", "max_steps=12"]  # ~4 steps per epoch
    reference = llmtrain(tmp_path, *epochs, f"hydra.run.dir={tmp_path / 'single'}")
    assert reference.returncode == 0, reference.stderr
    run = tmp_path / "run"
    stopped = llmtrain(tmp_path, *DDP, *epochs, f"hydra.run.dir={run}", env={"LLMTRAIN_TEST_STOP_AT_STEP": "6"})
    assert stopped.returncode == 75, stopped.stderr
    resumed = llmtrain(tmp_path, "parallel=single", *epochs, f"hydra.run.dir={run}")
    assert resumed.returncode == 0, resumed.stderr
    assert_close(losses(tmp_path / "single"), losses(run))


def test_instruction_data_trains_over_two_processes_like_one(tmp_path: Path) -> None:
    from .test_prepare import instruction_file

    path = instruction_file(tmp_path / "pairs.jsonl", n=40)
    args = ["data=instruct", f"data.path={path}", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
            "model.block_size=64", "model.dropout=0.0", "micro_batch_size=2", "global_batch_size=8", "max_steps=4",
            "schedule.warmup_steps=1", "eval_interval=2", "eval_batches=1", "log_interval=1"]

    def run(name: str, *extra: str) -> Path:
        proc = run_cli("train", *args, *extra, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        return tmp_path / name

    assert_close(losses(run("single")), losses(run("ddp", *DDP)))


def test_nproc_without_ddp_is_refused_before_any_run_dir(tmp_path: Path) -> None:
    proc = llmtrain(tmp_path, "parallel.nproc=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "add parallel=ddp" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
