"""The cases of the pathology benchmark (benchmarks/pathologies.py), their shapes and the split.

A *shape* is a healthy configuration: model, tokenizer, batch, context, length (and the optimizer
or data size where a sick case keeps them). Each shape has a healthy reference run (seed 1337, the
shape's overrides and nothing else); a sick case is its shape plus what makes it sick, and is judged
against that reference: when its symptoms start, and whether a repaired or rerun version ends
within 10% of the reference's validation loss. Every case is a small `llmtrain train` on the
embedded stdlib sources: BASE, then the shape's overrides, then the case's (`merge_overrides`: a
later value of the same key replaces the earlier one in place, as Hydra wants each key once).

The split: SPLIT_SEED deals the cases of each true cause (and the healthy runs, as one group) into
two halves, "tuning" and "held-out", by a seeded shuffle of their names; an odd one out goes by a
seeded coin. Adding a case re-deals its own cause only. Tune the monitor on the tuning half; the
held-out figures are the ones that count.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SPLIT_SEED = 20261203
TUNING, HELD_OUT = "tuning", "held-out"
BASE = ("model=gpt_tiny", "global_batch_size=8", "data.seq_len=128", "threads=1", "eval_interval=100",
        "eval_batches=4", "log_interval=10", "seed=1337")


def override_key(override: str) -> str:
    """'optim.lr=0.03' -> 'optim.lr'; Hydra's prefixes (+, ++, ~) do not make another key."""
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(base: Iterable[str], extra: Iterable[str]) -> tuple[str, ...]:
    """`base` with `extra` over it: an override of a key already there replaces it in place, a new
    key is appended (Hydra refuses a key given twice)."""
    merged: list[str] = []
    where: dict[str, int] = {}
    for override in (*base, *extra):
        key = override_key(override)
        if key in where:
            merged[where[key]] = override
        else:
            where[key] = len(merged)
            merged.append(override)
    return tuple(merged)


@dataclass(frozen=True)
class Shape:
    name: str
    overrides: tuple[str, ...]  # over BASE
    steps: int
    reference: str  # the healthy case with exactly these overrides and seed 1337
    what: str


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[str, ...]  # over BASE: the shape's, then the case's own
    cause: str | None  # the true cause (a diagnosis cause id); None for a healthy run
    steps: int = 200
    what: str = ""
    shape: str = "default"


_SHAPES = (
    Shape("default", (), 200, "c_seed1337", "gpt_tiny, bytes, 8 x 128"),
    Shape("char", ("data.tokenizer=char",), 200, "c_char", "gpt_tiny, chars, 8 x 128"),
    Shape("bpe", ("data.tokenizer=bpe", "data.bpe_vocab_size=4096"), 200, "c_bpe", "gpt_tiny, BPE 4096, 8 x 128"),
    Shape("modern", ("model=modern_tiny",), 200, "c_modern", "modern_tiny (RMSNorm, RoPE, SwiGLU), bytes, 8 x 128"),
    Shape("modern_bpe1k", ("model=modern_tiny", "data.tokenizer=bpe", "data.bpe_vocab_size=1024",
                           "global_batch_size=16", "data.seq_len=64"), 150, "c_modern_bpe1k",
          "modern_tiny, BPE 1024, 16 x 64"),
    Shape("llama", ("model=llama_tiny", "global_batch_size=16"), 150, "c_llama", "llama_tiny, bytes, 16 x 128"),
    Shape("llama_char", ("model=llama_tiny", "data.tokenizer=char", "global_batch_size=32", "data.seq_len=64"), 150,
          "c_llama_char", "llama_tiny, chars, 32 x 64"),
    Shape("llama_bpe", ("model=llama_tiny", "data.tokenizer=bpe", "data.bpe_vocab_size=4096", "data.seq_len=256"),
          150, "c_llama_bpe", "llama_tiny, BPE 4096, 8 x 256"),
    Shape("deep8", ("model.n_layer=8",), 200, "c_deep", "gpt_tiny at 8 blocks"),
    Shape("deep12", ("model.n_layer=12",), 200, "c_deep12", "gpt_tiny at 12 blocks"),
    Shape("deep16", ("model.n_layer=16",), 200, "c_deep16", "gpt_tiny at 16 blocks"),
    Shape("narrow6", ("model.n_layer=6", "model.n_embd=64"), 150, "c_narrow6", "6 blocks of width 64"),
    Shape("wide", ("model.n_embd=256", "model.n_head=8", "data.seq_len=64", "eval_batches=8"), 150, "c_wide",
          "width 256, 8 heads, 8 x 64"),
    Shape("ctx512", ("model.block_size=512", "data.seq_len=512"), 150, "c_ctx512", "gpt_tiny, 8 x 512"),
    Shape("batch64", ("global_batch_size=64", "data.seq_len=64"), 150, "c_batch64", "gpt_tiny, 64 x 64"),
    Shape("adam", ("optim=adam",), 150, "c_adam", "gpt_tiny, Adam"),
    Shape("sgd", ("optim=sgd",), 150, "c_sgd", "gpt_tiny, SGD (momentum 0.9, Nesterov)"),
    Shape("llama_sgd", ("model=llama_tiny", "global_batch_size=16", "optim=sgd"), 150, "c_llama_sgd",
          "llama_tiny, SGD, 16 x 128"),
    Shape("adafactor", ("optim=adafactor",), 150, "c_adafactor", "gpt_tiny, Adafactor"),
    Shape("fp16", ("precision=fp16",), 30, "c_fp16", "fp16 with its loss scaler (slow on CPU: 30 steps)"),
    Shape("bf16", ("precision=bf16",), 40, "c_bf16", "bf16 autocast (slow on CPU: 40 steps)"),
    # 12 kB of stdlib (~11,700 train tokens): validation turns up after ~150 steps of 8 x 128, so the
    # healthy reference stops there and the sick runs go on to 400.
    Shape("small", ("data.max_bytes=12000", "eval_interval=50"), 400, "c_small", "a 12 kB corpus, 8 x 128"),
    # Tiny batches at the LR such a batch bears (diagnosis: the default scaled by the root of the
    # batch's tokens against 4,096), evaluated on 4,096 tokens as the default shape is.
    Shape("batch2", ("global_batch_size=2", "data.seq_len=64", "optim.lr=5.3e-4", "eval_batches=32"), 300, "c_batch2",
          "2 x 64 tokens per step at LR 5.3e-4"),
    Shape("batch1", ("global_batch_size=1", "data.seq_len=64", "optim.lr=3.7e-4", "eval_batches=64"), 300, "c_batch1",
          "1 x 64 tokens per step at LR 3.7e-4"),
    # nanoGPT's shakespeare-char baby GPT (CPU settings) on our data.
    Shape("shakespeare", ("data.tokenizer=char", "model.n_layer=4", "model.n_head=4", "model.n_embd=128",
                          "model.bias=false", "model.dropout=0.2", "data.seq_len=64", "global_batch_size=12",
                          "optim.lr=1e-3", "optim.beta2=0.99", "schedule.warmup_fraction=0.05", "eval_interval=250"),
          2000, "c_shakespeare_char", "nanoGPT's shakespeare-char recipe, chars, 12 x 64, 2000 steps"),
)
SHAPES: dict[str, Shape] = {s.name: s for s in _SHAPES}


def healthy(name: str, shape: str, extra: tuple[str, ...] = (), what: str = "", steps: int | None = None) -> Case:
    s = SHAPES[shape]
    return Case(name, merge_overrides(s.overrides, extra), None, steps or s.steps, what or s.what, shape)


def sick(name: str, shape: str, extra: tuple[str, ...], cause: str, what: str, steps: int | None = None) -> Case:
    s = SHAPES[shape]
    return Case(name, merge_overrides(s.overrides, extra), cause, steps or s.steps, what, shape)


_REFERENCES = tuple(healthy(s.reference, s.name, what=f"{s.what} (reference)") for s in _SHAPES
                    if s.name not in ("small",))

HEALTHY: tuple[Case, ...] = (
    *_REFERENCES,
    healthy("c_small", "small", what="the 12 kB corpus, stopped at 150 steps before it overfits (reference)",
            steps=150),
    healthy("c_seed1", "default", ("seed=1",), "another seed"),
    healthy("c_seed2", "default", ("seed=2",), "another seed"),
    healthy("c_wsd", "default", ("schedule=wsd",), "warmup-stable-decay"),
    healthy("c_linear", "default", ("schedule=linear",), "linear decay"),
    healthy("c_accum", "default", ("micro_batch_size=2",), "gradient accumulation: 4 micro-batches of 2"),
    healthy("c_dropout", "default", ("model.dropout=0.1",), "dropout 0.1"),
    healthy("c_nobias", "default", ("model.bias=false",), "no biases"),
    healthy("c_warmup1", "default", ("schedule.warmup_fraction=0.01", "seed=13"), "warmup 1% (2 steps)"),
    healthy("c_warmup10", "default", ("schedule=linear", "schedule.warmup_fraction=0.1", "seed=14"),
            "linear decay, warmup 10%"),
    healthy("c_char_seed7", "char", ("seed=7", "model.dropout=0.2", "model.bias=false"),
            "chars, dropout 0.2, no biases"),
    healthy("c_char_accum", "char", ("micro_batch_size=4", "schedule=wsd"), "chars, 2 micro-batches of 4, wsd"),
    healthy("c_bpe_seed5", "bpe", ("seed=5", "schedule=wsd"), "BPE 4096, wsd, another seed"),
    healthy("c_bpe_accum", "bpe", ("micro_batch_size=4", "seed=12", "model.dropout=0.1"),
            "BPE 4096, 2 micro-batches of 4, dropout 0.1"),
    healthy("c_modern_seed11", "modern", ("seed=11", "schedule=linear"), "modern_tiny, linear decay"),
    healthy("c_modern_bpe1k_seed3", "modern_bpe1k", ("seed=3", "model.dropout=0.1"),
            "modern_tiny, BPE 1024, dropout 0.1"),
    healthy("c_llama_wsd", "llama", ("seed=4", "schedule=wsd"), "llama_tiny, wsd"),
    healthy("c_llama_char_accum", "llama_char", ("seed=9", "micro_batch_size=8"),
            "llama_tiny, chars, 4 micro-batches of 8"),
    healthy("c_adam_wsd", "adam", ("seed=6", "schedule=wsd"), "Adam, wsd"),
    healthy("c_sgd_linear", "sgd", ("seed=8", "schedule=linear"), "SGD, linear decay"),
    healthy("c_adafactor_seed10", "adafactor", ("seed=10", "schedule.warmup_fraction=0.02"),
            "Adafactor, warmup 2%"),
)

SICK: tuple[Case, ...] = (
    # ---- the learning rate (adamw's sane maximum at width 128: 9e-3) ----------------------------------
    sick("lr_10x", "default", ("optim.lr=0.03",), "lr_too_high", "LR 10x the default (3.3x the sane maximum)"),
    sick("lr_30x", "default", ("optim.lr=0.09",), "lr_too_high", "LR 30x the default (10x the sane maximum)"),
    sick("lr_huge", "default", ("optim.lr=1.0",), "lr_too_high", "LR 330x the default: diverges"),
    sick("lr_high_modern", "modern", ("optim.lr=0.9",), "lr_too_high", "modern_tiny at 100x the sane maximum"),
    sick("lr_high_adafactor", "adafactor", ("optim.lr=0.3",), "lr_too_high", "Adafactor at 10x its sane maximum"),
    sick("lr_high_sgd", "sgd", ("optim.lr=5.0",), "lr_too_high", "SGD at 10x its sane maximum"),
    sick("lr_high_llama_bpe", "llama_bpe", ("optim.lr=0.03",), "lr_too_high", "llama_tiny, BPE, 3.3x the sane maximum"),
    sick("lr_too_low", "default", ("optim.lr=1e-7",), "lr_too_low", "LR 1e-7: the loss barely moves"),
    sick("lr_low_modern", "modern", ("optim.lr=1e-5",), "lr_too_low", "modern_tiny at 1e-5 (10x below the sane range)"),
    sick("lr_low_bpe", "bpe", ("optim.lr=1e-6",), "lr_too_low", "BPE at 1e-6 (100x below)"),
    sick("no_warmup", "default", ("optim.lr=0.01", "schedule.warmup_steps=0"), "no_warmup",
         "no warmup at 3.3x the default LR"),
    sick("no_warmup_modern", "modern", ("optim.lr=0.008", "schedule.warmup_steps=0"), "no_warmup",
         "modern_tiny, no warmup at 0.008"),
    sick("no_warmup_llama_char", "llama_char", ("optim.lr=0.008", "schedule.warmup_steps=0"), "no_warmup",
         "llama_tiny, chars, no warmup at 0.008"),
    sick("schedule_ended", "default", ("schedule.total_steps=100", "schedule.min_lr_ratio=0"), "schedule_ended",
         "a 100-step schedule decaying to 0 in a 200-step run"),
    sick("schedule_ended_wsd", "char", ("schedule=wsd", "schedule.total_steps=120", "schedule.min_lr_ratio=0"),
         "schedule_ended", "chars, a 120-step wsd schedule to 0 in a 200-step run"),
    sick("batch_2", "batch2", ("optim.lr=null",), "batch_too_small", "2 x 64 tokens per step at the default LR"),
    sick("batch_2_lr8e3", "batch2", ("optim.lr=8e-3",), "batch_too_small", "2 x 64 tokens per step at LR 8e-3"),
    sick("batch_1", "batch1", ("optim.lr=null",), "batch_too_small", "1 x 64 tokens per step at the default LR"),
    # ---- the optimizer --------------------------------------------------------------------------------
    sick("no_clip_high_lr", "default", ("optim.lr=0.02", "optim.clip_grad_norm=null"), "no_clipping",
         "clipping off at 6.7x the default LR"),
    sick("no_clip_llama", "llama", ("optim.lr=0.03", "optim.clip_grad_norm=null"), "no_clipping",
         "llama_tiny, clipping off at 0.03"),
    sick("clip_1e4", "default", ("optim.clip_grad_norm=1e-4",), "clip_too_tight", "gradient clipped to norm 1e-4"),
    sick("clip_1e3_modern_bpe1k", "modern_bpe1k", ("optim.clip_grad_norm=1e-3",), "clip_too_tight",
         "modern_tiny, BPE 1024, clipped to 1e-3"),
    sick("eps_1", "default", ("optim.eps=1.0",), "eps_too_large", "AdamW epsilon 1"),
    sick("eps_01_adam", "adam", ("optim.eps=0.1",), "eps_too_large", "Adam epsilon 0.1"),
    sick("eps_1_llama", "llama", ("optim.eps=1.0",), "eps_too_large", "llama_tiny, AdamW epsilon 1"),
    sick("beta2_03", "default", ("optim.beta2=0.3",), "beta2_too_low", "Adam beta2 0.3"),
    sick("beta2_05_char", "char", ("optim.beta2=0.5",), "beta2_too_low", "chars, Adam beta2 0.5"),
    sick("sgd_no_momentum", "sgd", ("optim.momentum=0",), "sgd_without_momentum", "SGD, momentum 0"),
    sick("sgd_no_momentum_llama", "llama_sgd", ("optim.momentum=0",), "sgd_without_momentum",
         "llama_tiny, SGD, momentum 0"),
    sick("weight_decay_high", "default", ("optim.weight_decay=10",), "weight_decay_too_high", "weight decay 10"),
    sick("weight_decay_1_modern", "modern", ("optim.weight_decay=1",), "weight_decay_too_high",
         "modern_tiny, weight decay 1"),
    sick("weight_decay_10_llama", "llama", ("optim.weight_decay=10",), "weight_decay_too_high",
         "llama_tiny, weight decay 10"),
    sick("label_smoothing_05", "default", ("optim.label_smoothing=0.5",), "over_regularized", "label smoothing 0.5"),
    sick("dropout_06_char", "char", ("model.dropout=0.6",), "over_regularized", "chars, dropout 0.6"),
    # ---- initialization and architecture --------------------------------------------------------------
    sick("init_too_small", "default", ("model.init_std=1e-6",), "init_too_small", "init std 1e-6"),
    sick("init_1e6_llama", "llama", ("model.init_std=1e-6",), "init_too_small", "llama_tiny, init std 1e-6"),
    sick("init_too_large", "default", ("model.init_std=1.0",), "init_too_large", "init std 1.0"),
    sick("init_03_modern", "modern", ("model.init_std=0.3",), "init_too_large", "modern_tiny, init std 0.3"),
    sick("init_05_llama_char", "llama_char", ("model.init_std=0.5",), "init_too_large",
         "llama_tiny, chars, init std 0.5"),
    sick("residual_unscaled_deep", "deep16", ("model.residual_init=plain", "model.init_std=0.05"),
         "residual_unscaled", "16 blocks, plain residual init at std 0.05"),
    sick("residual_unscaled_8", "deep8", ("model.residual_init=plain", "model.init_std=0.1"),
         "residual_unscaled", "8 blocks, plain residual init at std 0.1"),
    sick("post_ln_deep", "deep12", ("model.norm_position=post",), "post_ln", "12-block post-LN"),
    sick("post_ln_8", "deep8", ("model.norm_position=post",), "post_ln", "8-block post-LN"),
    # 32 blocks of width 64 end ~6% above 6 blocks at 150 steps, with block outputs growing.
    sick("too_deep_32", "narrow6", ("model.n_layer=32",), "too_deep", "32 blocks of width 64"),
    # ---- precision and data ---------------------------------------------------------------------------
    sick("fp16_no_scaler", "fp16", ("precision.loss_scaling=false",), "fp16_no_scaler",
         "fp16 without a loss scaler (slow on CPU: 30 steps)"),
    sick("unshuffled", "default", ("data.shuffle=false",), "data_unshuffled", "windows read in file order"),
    sick("unshuffled_bpe", "bpe", ("data.shuffle=false",), "data_unshuffled", "BPE, windows in file order"),
    sick("unshuffled_llama_char", "llama_char", ("data.shuffle=false",), "data_unshuffled",
         "llama_tiny, chars, windows in file order"),
    sick("overfitting", "small", (), "overfitting", "400 steps on a 12 kB corpus (~35 epochs)"),
    sick("overfitting_no_decay", "small", ("optim.weight_decay=0", "seed=2"), "overfitting",
         "400 steps on a 12 kB corpus, no weight decay"),
)

CASES: tuple[Case, ...] = (*HEALTHY, *SICK)
BY_NAME: dict[str, Case] = {c.name: c for c in CASES}


# The pre-flight check's items that speak of each cause (llmtrain/preflight): a sick run whose item
# warns (or fails) was flagged before it started. Causes no item looks at are absent.
CHECK_ITEMS: dict[str, tuple[str, ...]] = {
    "lr_too_high": ("learning rate",), "lr_too_low": ("learning rate",),
    "batch_too_small": ("learning rate", "effective batch"), "no_warmup": ("warmup",),
    "schedule_ended": ("schedule length",), "no_clipping": ("gradient clipping",),
    "clip_too_tight": ("gradient clipping",), "sgd_without_momentum": ("momentum",),
    "init_too_small": ("init variance",), "init_too_large": ("init variance",),
    "residual_unscaled": ("init variance",), "post_ln": ("residual / norm",), "too_deep": ("residual / norm",),
    "fp16_no_scaler": ("mixed precision",), "data_unshuffled": ("data order",),
    "over_regularized": ("train/eval mode",),
}


def reference_of(case: Case) -> str:
    return SHAPES[case.shape].reference


def split_halves(cases: Sequence[Case], seed: int = SPLIT_SEED) -> dict[str, str]:
    """Case name -> TUNING or HELD_OUT, stratified by true cause (the healthy runs are one stratum):
    within each, a shuffle seeded by (seed, cause) of the sorted names, its first half to tuning; an
    odd one out goes by a coin of the same generator. Depends on the names only, never on their order."""
    strata: dict[str, list[str]] = {}
    for case in cases:
        strata.setdefault(case.cause or "healthy", []).append(case.name)
    halves: dict[str, str] = {}
    for cause in sorted(strata):
        names = sorted(strata[cause])
        rng = random.Random(f"{seed}/{cause}")
        rng.shuffle(names)
        cut = len(names) // 2 + (len(names) % 2 if rng.random() < 0.5 else 0)
        halves.update({name: TUNING if i < cut else HELD_OUT for i, name in enumerate(names)})
    return halves


HALVES: dict[str, str] = split_halves(CASES)

# ---- the time budget, a model of measured runs (one thread): gpt_tiny's 8 x 128-token step ~75 ms (a
# 200-step run ~21 s with start-up and report, two side by side as fast), 32 blocks of width 64 ~270 ms,
# 16 blocks ~290 ms, 8 x 512 ~400 ms, llama_tiny with BPE 4096 at 8 x 256 ~140 ms; the model errs high.
MODELS = {"gpt_tiny": (4, 128), "modern_tiny": (4, 128), "llama_tiny": (2, 64)}
START_S = 6.0  # process start, data, report
STEP_S = 0.005  # per optimizer step
LAYER_S = 0.004  # per block and micro-batch (kernel launches, hooks)
WORK_TOKENS_PER_S = 16_000.0  # tokens per second of gpt_tiny-sized work per token
HALF_PRECISION_SLOWDOWN = 2.0  # fp16/bf16 autocast on CPU (measured 1.6x)


def _work(layers: int, width: int, seq: int, vocab: int) -> float:
    """Multiply-adds per token: the blocks' matrices, attention, the head (its softmax and loss cost
    about 128 more per vocabulary entry: measured with BPE 4096 on llama_tiny)."""
    return 12 * layers * width**2 + 2 * layers * seq * width + (width + 128) * vocab


GPT_TINY_WORK = _work(4, 128, 128, 256)


def settings(case: Case) -> dict[str, str]:
    return dict(o.split("=", 1) for o in merge_overrides(BASE, case.overrides) if "=" in o)


def tokens_per_step(case: Case) -> int:
    s = settings(case)
    return int(s["global_batch_size"]) * int(s["data.seq_len"])


def estimated_seconds(case: Case, steps: int | None = None) -> float:
    """One thread's seconds for the case (a rough model of the measurements above)."""
    s = settings(case)
    steps = case.steps if steps is None else min(steps, case.steps)
    layers, width = MODELS[s["model"]]
    layers, width = int(s.get("model.n_layer", layers)), int(s.get("model.n_embd", width))
    batch, seq = int(s["global_batch_size"]), int(s["data.seq_len"])
    vocab = int(s.get("data.bpe_vocab_size", 4096)) if s.get("data.tokenizer") == "bpe" else 256
    work = _work(layers, width, seq, vocab) / GPT_TINY_WORK
    micro = int(s.get("micro_batch_size", max(d for d in range(1, 17) if batch % d == 0)))
    step = STEP_S + LAYER_S * layers * (batch // micro) + batch * seq * work / WORK_TOKENS_PER_S
    if s.get("precision") in ("fp16", "bf16"):
        step *= HALF_PRECISION_SLOWDOWN
    evals = steps // int(s["eval_interval"]) + 1
    eval_s = evals * int(s["eval_batches"]) * batch * seq * work / WORK_TOKENS_PER_S / 3
    return START_S + steps * step + eval_s


REPEATED = 1.3  # a repair that rolls back repeats the steps since the checkpoint
CONTENTION = 1.2  # a margin: two runs side by side ran as fast as one here, not on every machine


def budget_seconds(cases: Sequence[Case], jobs: int = 2, follow_ups: int = 2, steps: int | None = None) -> float:
    """Wall seconds for `cases` on `jobs` cores, each sick case run again `follow_ups` times (0-2: a rerun
    with its fix, a repair run; the worst case: every one of them)."""
    if not cases:
        return 0.0
    again = {0: 0.0, 1: 1.0, 2: 1.0 + REPEATED}[follow_ups]
    total = sum(estimated_seconds(c, steps) * (1 + (again if c.cause else 0)) for c in cases)
    return max(total * CONTENTION / jobs, max(estimated_seconds(c, steps) for c in cases))
