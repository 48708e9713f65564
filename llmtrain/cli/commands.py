"""The subcommands other than `train`: prepare, check, plan, sample, export, compare, report, doctor.

Each parses its own arguments with argparse, then imports what it runs (torch, rich, the runs/
readers) only once the arguments are good, so `--help` and a mistyped option answer at once. A
UserError becomes one paragraph and exit code 2 (`fail`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from llmtrain.cli.common import check_config_dir, fail, flush_denormals_first, parse_command_line
from llmtrain.cli.compose import compose_config

# ---------------------------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------------------------


def prepare_command(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="llmtrain prepare",
        description="Tokenize the data a config names into cached memory-mapped token files (train and val), once: "
        "unchanged inputs are reused, changed inputs rebuilt. `llmtrain train` does this itself when needed.",
        epilog="examples: llmtrain prepare data=text data.path=corpus/ data.tokenizer=bpe data.bpe_vocab_size=8192\n"
        "          llmtrain prepare data=jsonl data.path='dumps/*.jsonl' data.text_field=content",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*",
                        help="config overrides, as for `llmtrain train` (data=..., data.path=...)")
    parser.add_argument("--config-dir", "-cd", default=None, help="a folder of your own group options (as for train)")
    opts = parse_command_line(parser, args)
    check_config_dir(opts.config_dir)

    from rich.markup import escape

    from llmtrain.core.console import default_console
    from llmtrain.core.errors import UserError
    from llmtrain.data.prepare import prepare_data

    console = default_console()
    try:
        cfg = compose_config(opts.overrides, opts.config_dir)
        data = prepare_data(cfg.data, log=lambda message: console.print(f"[dim]{escape(message)}[/]"), progress=True)
    except UserError as err:
        fail(str(err))
    m = data.meta
    source = f"[bold]{cfg.data.source.value}[/] data"
    console.print(
        (f"prepared {source} in {data.directory}" if data.built
         else f"reused the {source} prepared in {data.directory} (its inputs are unchanged)") + "\n"
        f"  {m['documents']:,} document{'s' if m['documents'] != 1 else ''}, {m['source_bytes']:,} bytes -> "
        f"{m['train_tokens']:,} train / "
        f"{m['val_tokens']:,} val tokens ({m['dtype']})\n"
        f"  tokenizer {m['tokenizer']}, vocabulary {m['vocab_size']:,}; unigram entropy "
        f"{m['unigram_entropy_nats']:.4f} nats/token (the loss to beat)"
    )
    if (chat := m.get("chat_template")) and not data.built:  # a build logged it already, while formatting
        console.print(f"  formatted with the chat template {escape(chat['file'])}; the first example as the model "
                      f"sees it, »trained on«, the rest masked:\n{escape(chat['first_example'])}")
    if listed := m.get("degenerate_files"):  # what the pre-flight check of `llmtrain train` will warn about
        from llmtrain.data.quality import describe

        more = int(m.get("degenerate_file_count", len(listed))) - len(listed)
        console.print(f"  [yellow]warn[/] data content: {escape('; '.join(map(describe, listed)))}"
                      + (f"; and {more} more file(s)" if more > 0 else "")
                      + " -> remove or replace the named file(s) before training (`llmtrain check` says why)")


# ---------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------


def check_command(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="llmtrain check",
        description="Run the pre-flight checklist (settings that make training stable, plus static checks of the model "
        "and data) on a config, with a memory and "
        "compute estimate for this machine. Takes the same overrides as `llmtrain train`. "
        "Exit code: 0 all items pass, 1 warnings, 2 failures (or a bad config).",
        epilog="example: llmtrain check model=gpt_small optim=adamw precision=fp16",
    )
    parser.add_argument("overrides", nargs="*",
                        help="config overrides, as for `llmtrain train` (GROUP=OPTION, KEY=VALUE)")
    parser.add_argument("--config-dir", "-cd", default=None, help="a folder of your own group options (as for train)")
    parser.add_argument("--no-compute", action="store_true", help="skip the matmul measurement and the time estimate")
    opts = parse_command_line(parser, args)
    check_config_dir(opts.config_dir)

    from llmtrain.core.errors import UserError
    from llmtrain.preflight.check import run_check
    from llmtrain.preflight.render import render

    try:
        cfg = compose_config(opts.overrides, opts.config_dir)
        report = run_check(cfg, measure_compute=not opts.no_compute)
    except UserError as err:
        fail(str(err))
    render(report)
    sys.exit(report.exit_code)


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------


def plan_command(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="llmtrain plan",
        description="Which parallel layout a config needs on a number of devices, and why. For every layout of the\n"
        "devices (ddp, zero1, fsdp, hsdp, tensor and pipeline parallel and their mixes): the memory per device\n"
        "(weights, gradients, optimizer state, activations with and without activation checkpointing, the peak),\n"
        "the communication it adds per optimizer step and a pipeline's bubble; then the smallest change from\n"
        "plain data parallelism that fits, why, and the command that trains it. Takes the same overrides as\n"
        "`llmtrain train`. Exit code: 0 a layout fits, 1 only a tight one or none, 2 a bad config or option.",
        epilog="examples: llmtrain plan model=gpt2 precision=bf16 --devices 8 --device-memory 80GB\n"
        "          llmtrain plan model=smollm_135m precision=bf16 --devices 64 --device-memory 24GiB",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*",
                        help="config overrides, as for `llmtrain train` (GROUP=OPTION, KEY=VALUE)")
    parser.add_argument("--config-dir", "-cd", default=None, help="a folder of your own group options (as for train)")
    parser.add_argument("--devices", default=None, metavar="N",
                        help="devices to plan for (default: this machine's CUDA devices, else 1)")
    parser.add_argument("--device-memory", default=None, metavar="SIZE",
                        help="memory of each device, e.g. 80GB, 80GiB or 24G (2^30 bytes a G, as GPU makers count) "
                        "(default: this machine's free memory; given on a machine without CUDA, the plan is for CUDA "
                        "devices)")
    opts = parse_command_line(parser, args)
    check_config_dir(opts.config_dir)

    from llmtrain.core.errors import UserError
    from llmtrain.plan.units import parse_devices, parse_memory

    try:  # the figures first, before torch loads: a typo is refused at once
        devices = parse_devices(opts.devices) if opts.devices is not None else None
        memory = parse_memory(opts.device_memory) if opts.device_memory is not None else None
    except UserError as err:
        fail(str(err))

    from llmtrain.plan.build import plan_config
    from llmtrain.plan.render import render_plan

    try:
        cfg = compose_config(opts.overrides, opts.config_dir)
        plan = plan_config(cfg, devices, memory, opts.overrides, opts.config_dir)
    except UserError as err:
        fail(str(err))
    render_plan(plan)
    sys.exit(plan.exit_code)


# ---------------------------------------------------------------------------------------------
# sample
# ---------------------------------------------------------------------------------------------


def sample_command(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="llmtrain sample", description="Generate text from a trained run.")
    parser.add_argument("run_dir", type=Path, help="run directory written by `llmtrain train`")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--max-new-tokens", type=int, default=400, help="tokens to generate (default 400)")
    # The model's own distribution by default: a small byte-level model sampled colder (or top-k
    # truncated) falls into its most likely loop, e.g. endless runs of indentation spaces.
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy (default 1.0)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample among the k likeliest tokens only (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed: same seed, same text (default 0)")
    parser.add_argument("--ignore-end-of-text", action="store_true",
                        help="keep generating past the end-of-text token (by default the text ends there: the model "
                        "says its document is over)")
    opts = parser.parse_args(args)
    if opts.max_new_tokens < 1:
        fail(f"--max-new-tokens is {opts.max_new_tokens}; it must be >= 1.")
    if opts.top_k is not None and opts.top_k < 1:
        fail(f"--top-k is {opts.top_k}; it must be >= 1.")
    if not 0 <= opts.temperature < float("inf"):  # NaN fails this too
        fail(f"--temperature is {opts.temperature}; use 0 for greedy decoding (always the likeliest token) or a finite "
             "number > 0 (1.0, the default, samples the model's own distribution; below 1 is more conservative).")
    if not -(2**63) <= opts.seed < 2**64:
        fail(f"--seed is {opts.seed}; use an integer between -2**63 and 2**64 - 1 (e.g. --seed 1).")

    from llmtrain.core.errors import UserError
    from llmtrain.runs.sample import sample_text

    try:
        text = sample_text(opts.run_dir, opts.prompt, opts.max_new_tokens, opts.temperature, opts.top_k, opts.seed,
                           stop_at_end_of_text=not opts.ignore_end_of_text)
    except UserError as err:
        fail(str(err))
    sys.stdout.write(opts.prompt + text + "\n")


def export_command(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="llmtrain export", description="Export a run's weights for inference: in llmtrain's own format "
        "(model.safetensors, model_config.json, tokenizer.json; `llmtrain sample` reads it), or as a Hugging Face "
        "folder that transformers loads with no llmtrain code (GPT-2- and Llama-style models), or a LoRA run's "
        "adapters as peft's adapter folder.",
        epilog="examples: llmtrain export outputs/2024-05-01/12-00-00\n"
        "          llmtrain export outputs/2024-05-01/12-00-00 --format hf --out my-model\n"
        "          llmtrain export outputs/2024-05-01/12-00-00 --format peft --out my-adapter",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", type=Path, help="run directory written by `llmtrain train` (or an export)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder: new, empty, or a previous export (replaced whole); any other folder is "
                        "refused (default: RUN_DIR/export, RUN_DIR/export-hf or RUN_DIR/export-peft)")
    parser.add_argument("--format", choices=("llmtrain", "hf", "peft"), default="llmtrain",
                        help="llmtrain (default); hf: config.json, model.safetensors, generation_config.json and "
                        "tokenizer files for transformers' from_pretrained; peft: a LoRA run's adapter_config.json "
                        "and adapter_model.safetensors (and tokenizer files) for peft's PeftModel.from_pretrained")
    opts = parser.parse_args(args)

    from llmtrain.core.errors import UserError
    from llmtrain.runs.export import export_run

    try:
        out = export_run(opts.run_dir, opts.out, opts.format)
    except UserError as err:
        fail(str(err))
    if opts.format == "llmtrain":
        print(f"exported to {out}: model.safetensors, model_config.json, tokenizer.json "
              f"(sample it: llmtrain sample {out})")
        return
    if opts.format == "peft":
        _print_peft_export(out)
        return
    _print_hf_export(out)


def _print_peft_export(out: Path) -> None:
    """What a peft export wrote and the lines that load it onto its base."""
    import json

    from safetensors import safe_open

    from llmtrain.hf.peft_export import QUANTIZED_BASE

    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as handle:
        quantized = QUANTIZED_BASE in (handle.metadata() or {})
    print(f"exported to {out} as a peft LoRA adapter for {base}: adapter_config.json, adapter_model.safetensors "
          f"({(out / 'adapter_model.safetensors').stat().st_size / 1e6:.2f} MB), tokenizer files\n"
          "load it with transformers and peft:\n"
          "  from peft import PeftModel\n  from transformers import AutoModelForCausalLM\n"
          f"  model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base!r}), {str(out)!r})")
    if quantized:  # the adapters are a correction to the NF4 weights, which no peft base reproduces exactly
        print("note: these QLoRA adapters trained against the base quantized to NF4 (torchao); on the base in full "
              "precision, or quantized by bitsandbytes, the logits differ from the run's by the quantization error. "
              "`llmtrain export RUN_DIR --format hf` writes the merged model exactly as the run computed it.")


def _print_hf_export(out: Path) -> None:
    """What an HF export wrote (files and sizes) and the transformers lines that load it."""
    import json

    files = sorted(p for p in out.iterdir() if p.is_file())
    listing = ", ".join(f"{p.name} ({p.stat().st_size / 1e6:.1f} MB)" if p.stat().st_size >= 1e5 else p.name
                        for p in files)
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    where = repr(str(out))
    print(f"exported to {out} as a Hugging Face {architecture}: {listing}\n"
          f"load it with transformers (no llmtrain needed):\n"
          f"  from transformers import AutoModelForCausalLM, AutoTokenizer\n"
          f"  model = AutoModelForCausalLM.from_pretrained({where}); "
          f"tokenizer = AutoTokenizer.from_pretrained({where})\n"
          f"or sample it here: llmtrain sample {out}")


# ---------------------------------------------------------------------------------------------
# compare
# ---------------------------------------------------------------------------------------------


def compare_command(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="llmtrain compare",
        description="Compare the runs of a sweep (`llmtrain train -m ...`): overrides, final train/val loss, best "
        "val loss and step, alarms, tokens/s, status; sorted by final val loss. Writes compare.csv and compare.png "
        "(loss curves) into the sweep dir.",
        epilog="example: llmtrain train -m optim.lr=1e-3,3e-3,1e-2 max_steps=200 && "
        "llmtrain compare multirun/<date>/<time>",
    )
    parser.add_argument("sweep_dir", type=Path, help="the sweep dir (or any folder of run dirs)")
    parser.add_argument("--csv", type=Path, default=None, help="where the CSV goes (default: <sweep dir>/compare.csv)")
    parser.add_argument("--png", type=Path, default=None, help="where the plot goes (default: <sweep dir>/compare.png)")
    opts = parser.parse_args(args)

    from rich.markup import escape
    from rich.table import Table

    from llmtrain.core.console import default_console
    from llmtrain.core.errors import UserError
    from llmtrain.runs.compare import columns, compare_runs, plot_curves, ranking, rows, write_csv

    try:
        summaries, common = compare_runs(opts.sweep_dir)
    except UserError as err:
        fail(str(err))
    csv_path = opts.csv or opts.sweep_dir / "compare.csv"
    png_path = opts.png or opts.sweep_dir / "compare.png"
    title = f"{len(summaries)} run{'s' if len(summaries) != 1 else ''} in {opts.sweep_dir}"
    table = Table(title=title, caption=f"common to all: {escape(' '.join(common))}" if common else None,
                  title_justify="left", caption_justify="left")
    for column in columns(summaries):
        table.add_column(column, overflow="fold")
    for row in rows(summaries, opts.sweep_dir):
        table.add_row(*map(escape, row))  # overrides such as eval.tasks=[...] are text, not markup
    console = default_console()
    console.print(table)
    if note := ranking(summaries).note:  # the runs' tokenizers differ: what the order means
        console.print(f"note: {escape(note)}", highlight=False)
    write_csv(summaries, opts.sweep_dir, csv_path)
    left_out = plot_curves(summaries, png_path, title + (f"\ncommon: {' '.join(common)}" if common else ""))
    console.print(f"wrote {csv_path} and {png_path}" if left_out is None else f"wrote {csv_path}; {left_out}")


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def report_command(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="llmtrain report",
        description="The post-run review of a run dir, finished, interrupted or crashed: is the loss smooth, "
        "does validation track training, does inference behave like training, peak memory and headroom, time per "
        "step and its bottleneck, alarms and actions. Writes report.md and a self-contained report.html (plots "
        "inside) into the run dir and prints the verdicts. `llmtrain train` writes it at the end of every run.",
        epilog="example: llmtrain report outputs/2026-11-30/10-00-00",
    )
    parser.add_argument("run_dir", type=Path, help="a run dir written by `llmtrain train`")
    parser.add_argument("--no-inference", action="store_true",
                        help="skip reloading the weights for the inference-vs-training check")
    parser.add_argument("--short", action="store_true",
                        help="print only the verdicts that are not ok, a line each, and the report's path (as "
                        "train does with report.console=short) instead of the table")
    opts = parser.parse_args(args)

    from llmtrain.core.console import default_console
    from llmtrain.core.errors import UserError
    from llmtrain.runs.report import write_report
    from llmtrain.runs.report.render import render_console

    console = default_console()
    try:
        report = write_report(opts.run_dir, inference=not opts.no_inference)
    except UserError as err:
        fail(str(err))
    render_console(report, console, "short" if opts.short else "full")  # asked for: the table unless --short


# ---------------------------------------------------------------------------------------------
# doctor
# ---------------------------------------------------------------------------------------------


def doctor_command(args: list[str]) -> None:
    import argparse

    from llmtrain.doctor import EXPERIMENTS

    parser = argparse.ArgumentParser(
        prog="llmtrain doctor",
        description="Diagnostic experiments on a config (the same overrides as `llmtrain train`):\n"
        + "\n".join(f"  {name}: {doc}" for name, doc in EXPERIMENTS.items())
        + "\nExit code 0: the experiment passed; 1: it found a problem (the output says which and what to check).",
        epilog="examples: llmtrain doctor overfit\n          llmtrain doctor lr-range optim=adamw model.n_layer=4\n"
        "          llmtrain doctor grad-check model.dropout=0.1",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("experiment", choices=list(EXPERIMENTS), help="which experiment to run")
    parser.add_argument("overrides", nargs="*",
                        help="config overrides, as for `llmtrain train` (GROUP=OPTION, KEY=VALUE)")
    parser.add_argument("--config-dir", "-cd", default=None, help="a folder of your own group options (as for train)")
    parser.add_argument("--out", type=Path, default=Path("doctor"),
                        help="where plots and results go (default: ./doctor)")
    opts = parse_command_line(parser, args)
    check_config_dir(opts.config_dir)

    from llmtrain.core.console import default_console
    from llmtrain.core.errors import UserError
    from llmtrain.doctor import run_doctor

    flush_denormals_first(opts.overrides)  # as train does: the doctor's steps are the train loop's
    try:
        cfg = compose_config(opts.overrides, opts.config_dir)
        code = run_doctor(opts.experiment, cfg, opts.out, default_console())
    except UserError as err:
        fail(str(err))
    sys.exit(code)
