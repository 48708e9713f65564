"""Every `llmtrain ...` command line in README.md and docs/*.md is composed and pre-flight-checked the
way `llmtrain train` does before it builds anything, so a documented example cannot break silently.

Commands come from fenced code blocks (lines starting with `llmtrain `, `$ llmtrain `, an
environment prefix, or `torchrun ... -m llmtrain`, joined over `\\` continuations) and from inline
code in the prose. `train`, `check`, `prepare` and `doctor` commands are composed from the shipped
config with their overrides (in a folder holding tiny stand-ins for the docs' placeholder files):
`train` also runs the pre-flight check unless it only prints (`--cfg`, `--info`). An example whose
transcript shows `llmtrain: error: ...` must fail with that message; one whose error comes after a
`preparing ...` line is found while reading the data, so its composition must pass. Other commands
(sample, export, report, compare) need a finished run: only their command name is checked.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llmtrain.cli import COMMANDS
from llmtrain.cli.compose import validate_overrides
from llmtrain.core.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMPOSED = ("train", "check", "prepare", "doctor")
# Rows of the pre-flight check that depend on the machine running it, not on the documented config.
MACHINE_ROWS = {"memory"}

# Documented commands this test cannot compose as written, each with the reason (reviewed).
# Keyed by the command's words as extracted (after placeholders are substituted).
SKIP: dict[str, str] = {
    "llmtrain prepare data=hf data.hf_name=saved data.hf_split=validation data.text_field=content":
        "needs a dataset written by Dataset.save_to_disk with train/test splits",
    "llmtrain prepare data=hf data.hf_name=no_such_user/no_such_dataset":
        "shows the Hugging Face Hub's offline error: needs the datasets package and HF_DATASETS_OFFLINE",
    "llmtrain train data=text data.path=corpus/ data.tokenizer=bpe data.bpe_vocab_size=1024 model.vocab_size=512 "
    "max_steps=3 threads=1 hydra.run.dir=run2":
        "the check finds the small vocabulary only once the data is prepared (the doc prepares it first)",
    "llmtrain prepare data=text data.path=corpus/ data.tokenizer=gpt2 data.gpt2_dir=toy_gpt2":
        "needs GPT-2's vocab.bpe and encoder.json in toy_gpt2/",
    "llmtrain prepare data=text data.path=tests/assets/tiny_corpus.txt data.tokenizer=gpt2":
        "shows the error for GPT-2 files missing from TIKTOKEN_CACHE_DIR, found when the tokenizer loads",
    "llmtrain train data=hf data.hf_name=roneneldan/TinyStories": "downloads a dataset from the Hugging Face Hub",
    "llmtrain train data=text data.path=story.txt data.tokenizer=char model.block_size=64 max_steps=4 "
    "schedule.warmup_steps=1 eval_interval=0 threads=1 hydra.run.dir=runs/c":
        "refused by the resume check against the run dir that the command before it wrote",
    "llmtrain train parallel=ddp parallel.nproc=2 checkpoint.every_steps=1":
        "LLMTRAIN_TEST_CRASH_RANK_AT crashes a rank at run time on purpose",
}
# Commands elided with `...` in the docs, completed here with what the prose around them says.
COMPLETE: dict[str, list[str]] = {
    # a schedule whose last stage starts at step 3000 needs a longer run than the default 1000 steps
    "llmtrain train data.seq_len_schedule=[[0,256],[1000,512],[3000,1024]] model.block_size=1024": ["max_steps=5000"],
}
# Sweeps through a launcher or sweeper plugin: composed only when the plugin is installed.
PLUGINS = {
    "hydra/launcher=slurm": "hydra_plugins.hydra_submitit_launcher",
    "hydra/sweeper=lr_search": "hydra_plugins.hydra_optuna_sweeper",
}


@dataclass
class DocCommand:
    where: str  # file:line
    text: str  # the command as written (continuations joined)
    words: list[str] = field(default_factory=list)  # argv after `llmtrain`
    env: dict[str, str] = field(default_factory=dict)
    error: str | None = None  # the documented `llmtrain: error: ...` message
    error_after_preparing: bool = False


COMMAND_LINE = re.compile(r"^(?:\$ )?(?:[A-Z_][A-Z0-9_]*=\S* )*(?:torchrun \S.*?-m )?llmtrain [a-z]")
INLINE = re.compile(r"`((?:[A-Z_][A-Z0-9_]*=\S* )*(?:torchrun [^`]*?-m )?llmtrain [a-z][^`]*)`")


def _parse(text: str, where: str) -> DocCommand | None:
    """The command's words and environment, or None for a usage synopsis (`llmtrain check [OVERRIDES ...]`)."""
    try:
        words = shlex.split(text.removeprefix("$ "), comments=True)
    except ValueError:
        return None
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words and words[0] == "torchrun":
        nproc = next((w.split("=", 1)[1] for w in words if w.startswith("--nproc_per_node=")), "1")
        env["WORLD_SIZE"] = nproc  # what torchrun gives each rank
        words = words[words.index("llmtrain"):]
    if not words or words[0] != "llmtrain" or len(words) < 2 or words[1] not in COMMANDS:
        return None
    words = [w for w in words[1:] if w != "..."]  # `...`: the rest of a command, elided
    # A usage synopsis (`[OVERRIDES ...]`, `overfit | lr-range`) or a placeholder (`<its overrides>`,
    # `optim.lr=...`) in a command that composes a config: nothing to compose.
    synopsis = any(re.match(r"\[[A-Za-z-]", w) or w == "|" or "..." in w or "<" in w for w in words)
    if synopsis and words[0] in COMPOSED:
        return None
    return DocCommand(where, text, words, env)


def extract(path: Path) -> list[DocCommand]:
    lines = path.read_text().splitlines()
    found: list[DocCommand] = []
    prose: list[tuple[int, str]] = []
    fence: str | None = None
    current: DocCommand | None = None
    i = 0
    while i < len(lines):
        raw = lines[i]
        stripped = raw.strip()
        if stripped.startswith("```"):
            fence = None if fence else stripped
            current = None
            i += 1
            continue
        if fence is None:
            prose.append((i + 1, raw))
            i += 1
            continue
        if COMMAND_LINE.match(stripped):
            start = i
            text = stripped
            while text.endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text[:-1].rstrip() + " " + lines[i].strip()
            current = _parse(text, f"{path.name}:{start + 1}")
            if current is not None:
                found.append(current)
        elif current is not None and stripped.startswith("llmtrain: error: ") and current.error is None:
            current.error = stripped.removeprefix("llmtrain: error: ")
        elif current is not None and stripped.startswith("preparing ") and current.error is None:
            current.error_after_preparing = True
        i += 1
    # Inline code may wrap over lines of a paragraph: scan the prose with line breaks as spaces.
    text = "\n".join(line for _, line in prose)
    for match in INLINE.finditer(text.replace("\n", " ")):
        line = prose[min(text[:match.start()].count("\n"), len(prose) - 1)][0]
        command = _parse(" ".join(match.group(1).split()), f"{path.name}:{line}")
        if command is not None and command.words[0] in COMPOSED and len(command.words) > 1:
            found.append(command)
    return found


def all_commands() -> list[DocCommand]:
    unique: dict[tuple[str, ...], DocCommand] = {}
    for path in DOC_FILES:
        for command in extract(path):
            key = (*command.words, *sorted(command.env.items()), command.error or "")
            unique.setdefault(key, command)
    return list(unique.values())


COMMANDS_IN_DOCS = all_commands()


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stand-ins for the Hugging Face folders the docs fine-tune from (models/gpt2, models/SmolLM-135M):
    tiny GPT-2 and Llama-family models with a byte tokenizer, written by llmtrain's own HF export."""
    import torch

    from llmtrain.config.schema import MlpKind, ModelConfig, NormKind, PositionEncoding
    from llmtrain.data.tokenizers import ByteTokenizer
    from llmtrain.hf.export import export_hf
    from llmtrain.model import GPT

    root = tmp_path_factory.mktemp("models")
    small = {"n_layer": 1, "n_head": 2, "block_size": 1024}
    shapes = {"gpt2": ModelConfig(name="gpt2", **small, n_embd=16),
              # 64 wide: finetune=qlora stores its layers in NF4 blocks of 64 values
              "SmolLM-135M": ModelConfig(name="smol", **small, n_embd=64, n_kv_head=1, position=PositionEncoding.rope,
                                         norm=NormKind.rmsnorm, mlp=MlpKind.swiglu, bias=False)}
    torch.manual_seed(0)
    for name, cfg in shapes.items():
        export_hf(GPT(cfg, 256), ByteTokenizer().to_dict(), cfg.block_size, root / name)
    return root


@pytest.fixture
def doc_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hf_folders: Path) -> Path:
    """A working folder with tiny stand-ins for the files the docs name (corpus.txt, docs.jsonl, ...)."""
    text = "A small corpus for the documentation's examples, one sentence after another.\n" * 60
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(text)
    for name in ("corpus.txt", "story.txt"):
        (tmp_path / name).write_text(text)
    jsonl = "".join(f'{{"id": {i}, "content": "document {i}: {text[:60]}"}}\n' for i in range(40))
    (tmp_path / "docs.jsonl").write_text(jsonl)
    (tmp_path / "bad.jsonl").write_text(jsonl + '{"content": "ok"}\n{content: bad}\n')
    (tmp_path / "list_field.jsonl").write_text('{"text": "First line."}\n{"text": ["a", "list"]}\n')
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "legacy.txt").write_bytes(b"caf\xe9 au lait\n" * 20)
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty.txt").write_text("")
    # -cd DIR with options of your own, as configuration.md writes them
    (tmp_path / "DIR" / "model").mkdir(parents=True)
    (tmp_path / "DIR" / "model" / "mine.yaml").write_text((ROOT / "conf" / "model" / "gpt_tiny.yaml").read_text())
    (tmp_path / "DIR" / "preset").mkdir()
    (tmp_path / "DIR" / "preset" / "mine.yaml").write_text("# @package _global_\nmax_steps: 7\n")
    (tmp_path / "chats.jsonl").write_text("".join(
        f'{{"prompt": "Question {i}?", "response": "Answer {i}: {text[:40]}"}}\n' for i in range(40)))
    (tmp_path / "models").symlink_to(hf_folders)  # model.init_from=models/gpt2, models/SmolLM-135M
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "assets").symlink_to(ROOT / "tests" / "assets")  # docs run from a checkout
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_docs_have_commands_and_the_ddp_example_is_among_them() -> None:
    words = [" ".join(c.words) for c in COMMANDS_IN_DOCS]
    assert len(words) > 40, words
    assert "train parallel=ddp parallel.nproc=2" in words, "the README's two-process example"
    assert any(c.env.get("WORLD_SIZE") == "2" for c in COMMANDS_IN_DOCS), "the torchrun example"
    assert any(c.error for c in COMMANDS_IN_DOCS), "the documented error examples"


def _run(command: DocCommand, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compose and check `command` as its CLI command would, before any work; raises UserError."""
    from hydra._internal.utils import get_args_parser

    from llmtrain.cli import common

    def refuse(message: str, code: int = 2, label: str = "error") -> None:
        raise UserError(message)  # what the CLI prints as its one paragraph

    name, args = command.words[0], command.words[1:]
    if name == "train":
        parser = get_args_parser()
        parser.prog = "llmtrain train"
        monkeypatch.setattr(common, "fail", refuse)
        parsed = common.parse_command_line(parser, args)
        if parsed.help or parsed.hydra_help or parsed.shell_completion:
            return  # as train_command: these print and compose nothing
        validate_overrides(parsed.overrides, multirun=parsed.multirun, extra_dir=parsed.config_dir,
                           config_name=parsed.config_name, preflight=not (parsed.cfg or parsed.info))
        return
    if name == "doctor":
        args = args[1:]  # the experiment's name
    overrides, extra_dir = [], None
    words = iter(args)
    for word in words:
        if word in ("-cd", "--config-dir"):
            extra_dir = next(words)
        elif word == "--out":
            next(words)
        elif not word.startswith("-"):  # --no-compute, --no-inference: no config
            overrides.append(word)
    validate_overrides(overrides, extra_dir=extra_dir)


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS_IN_DOCS,
                         ids=[f"{c.where} {' '.join(c.words)}"[:120] for c in COMMANDS_IN_DOCS])
def test_documented_command_is_accepted_or_fails_as_documented(
    command: DocCommand, doc_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmtrain.preflight.check import CheckFailed

    key = " ".join(["llmtrain", *command.words])
    if key in SKIP:
        pytest.skip(SKIP[key])
    if command.words[0] not in COMPOSED:
        return  # sample/export/report/compare need a finished run; the command name is valid
    for plugin, module in PLUGINS.items():
        if plugin in command.words:
            pytest.importorskip(module, reason=f"{plugin} needs its Hydra plugin")
    command.words += COMPLETE.get(key, [])
    for name, value in command.env.items():
        monkeypatch.setenv(name, value)
    try:
        _run(command, monkeypatch)
    except CheckFailed as failed:
        machine_only = all(row.item in MACHINE_ROWS for row in failed.report.failures)
        assert machine_only and command.error is None, f"{command.where}: `{command.text}` is refused:\n{failed}"
        return
    except UserError as err:
        assert command.error is not None and not command.error_after_preparing, (
            f"{command.where}: `{command.text}` is refused:\n{err}")
        documented = command.error.split("...")[0][:40]
        assert str(err).startswith(documented), f"{command.where}: the doc says\n  {command.error}\nbut it is\n  {err}"
        return
    assert command.error is None or command.error_after_preparing, (
        f"{command.where}: the doc shows `{command.text}` failing with\n  {command.error}\nbut it is accepted")
