"""`llmtrain configs`: the catalogue of groups and options (llmtrain.config.catalog), the same one
`llmtrain train --help` lists; called in-process (the command imports neither Hydra nor torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmtrain.cli import COMMANDS, main
from llmtrain.cli.common import conf_dir
from llmtrain.cli.completion import complete
from llmtrain.cli.train import train_help
from llmtrain.config.catalog import catalog, description, model_params

from .faults.test_newcomer_errors import CITATION

CONF = conf_dir()
# Every folder of conf/ a user picks from: the schema's groups, presets, Hydra's launcher and
# sweeper; hydra/job_logging is llmtrain's own plumbing.
SHIPPED = {
    (str(path.parent.relative_to(CONF)), path.stem)
    for path in CONF.glob("**/*.yaml") if path.parent != CONF and "job_logging" not in path.parts
}
MODEL_OPTIONS = sorted(option for group, option in SHIPPED if group == "model")


def run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    main(["configs", *args])
    return capsys.readouterr().out


def flat(text: str) -> str:
    """Wrapped lines joined back, for finding a sentence however the terminal width wrapped it."""
    return " ".join(text.split())


@pytest.fixture(autouse=True)
def _width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")


def test_every_group_and_option_is_listed_with_its_description(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys)
    groups = {g.name: g for g in catalog(CONF)}
    assert {(g, o.name) for g in groups for o in groups[g].options} == SHIPPED
    listed = flat(out)
    for group, name in sorted(SHIPPED):
        option = groups[group].option(name)
        assert option.description, f"{group}={name} has no header comment to describe it"
        assert f"{group}: " in out
        assert flat(option.description) in listed, f"{group}={name}"
    for default in ("gpt_tiny*", "adamw*", "cosine*", "python_stdlib*", "fp32*", "single*"):
        assert f"  {default} " in out  # the default of each group is marked
    assert "preset=[stable,fast]" in out and "Hydra's basic launcher" in out
    assert not CITATION.search(out), CITATION.search(out)  # no document the user does not have


def test_descriptions_are_the_first_sentence_of_the_header_comment() -> None:
    stable = description((CONF / "preset" / "stable.yaml").read_text(), "stable", "preset")
    assert stable.startswith("The pre-flight checklist's stability items switched on")  # label and @package skipped
    assert stable.endswith("(the usual compromise: AdamW + warmup + clipping).")
    assert description("# Adam, e.g. lr 0.02. More.\nname: adam\n") == "Adam, e.g. lr 0.02."
    assert description("# A dataset: a name\n#   llmtrain train data=x\nsource: x\n") == "A dataset: a name"
    assert description("name: bare\n") == ""


def test_model_options_show_parameters_context_and_the_vocabulary_assumed(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "model")
    assert out.startswith("model: Model shape and initialization.")
    assert "gpt_small     86.0M params (vocab 256: bytes), context 1,024. The GPT-2 124M shape" in out
    assert "gpt2          124.4M params (vocab 50,257: GPT-2), context 1,024." in out
    assert "134.5M params (vocab 49,152: model.vocab_size), context 2,048." in out
    assert "params: at the vocabulary shown" in flat(out)
    assert "optim:" not in out  # one group only


@pytest.mark.parametrize("name", MODEL_OPTIONS)
def test_parameter_count_equals_the_models_own(name: str) -> None:
    """The catalogue's formula against llmtrain.model.GPT built with the option's shape, at the
    vocabulary the listing states (on the meta device: no memory, no init)."""
    import torch

    from llmtrain.config.hydra import model_config_from_dict
    from llmtrain.model import GPT, param_count, uninitialized

    option = next(g for g in catalog(CONF) if g.name == "model").option(name)
    with torch.device("meta"), uninitialized():
        model = GPT(model_config_from_dict(yaml.safe_load(option.path.read_text())), option.model.vocab)
    assert option.model.params == param_count(model)
    assert option.model.context == model.cfg.block_size


@pytest.mark.parametrize("changes", [
    {"norm_position": "post"}, {"bias": False}, {"tie_weights": False, "vocab_size": 1000},
    {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu"}, {"n_kv_head": 2, "mlp": "swiglu", "mlp_ratio": 3.0},
    {"intermediate_size": 200, "bias": False, "norm": "rmsnorm"},
])
def test_parameter_formula_holds_for_each_switch_of_the_shape(changes: dict) -> None:
    import torch

    from llmtrain.config.hydra import model_config_from_dict
    from llmtrain.config.schema import ModelConfig, config_to_dict
    from llmtrain.model import GPT, param_count, uninitialized

    shape = {**config_to_dict(ModelConfig()), **changes}
    with torch.device("meta"), uninitialized():
        model = GPT(model_config_from_dict(shape), 300)
    assert model_params(shape, 300) == param_count(model)


def test_presets_show_the_keys_they_set(capsys: pytest.CaptureFixture[str]) -> None:
    out = flat(run(capsys, "preset"))
    stable = out.split("stable The pre-flight checklist's stability items switched on")[1]
    for key in ("schedule.warmup_fraction=0.05", "optim.clip_grad_norm=1.0", "precision.name=auto",
                "model.norm_position=pre"):
        assert key in stable.split(" Sets ")[1]
    assert "fast Throughput first. Sets compile=auto, optim.fused=true, precision.name=auto." in out


def test_an_option_prints_its_yaml_byte_for_byte(capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    main(["configs", "model=gpt_small"])
    assert capsysbinary.readouterr().out == (CONF / "model" / "gpt_small.yaml").read_bytes()
    main(["configs", "preset=stable"])
    assert capsysbinary.readouterr().out == (CONF / "preset" / "stable.yaml").read_bytes()


def test_config_dir_adds_the_users_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model").mkdir()
    mine = tmp_path / "model" / "mine.yaml"
    mine.write_text("# My own: two layers, width 64.\nname: mine\nn_layer: 2\nn_embd: 64\nn_head: 2\n")
    (tmp_path / "model" / "gpt_tiny.yaml").write_text("# A copy.\nn_layer: 7\n")
    out = run(capsys, "-cd", str(tmp_path), "model")
    line = next(line for line in out.splitlines() if line.startswith("  mine "))
    assert "params (vocab 256: bytes), context 256. My own: two layers, width 64." in line
    # a path longer than the line is broken inside (the tmp dir's length varies: -n 2's workers add to it)
    assert f"(yours:{mine}" in "".join(out.split())
    assert "the shipped option of this name is found first" in flat(out)  # Hydra's search order
    assert "mine" not in run(capsys, "model")  # without -cd: the shipped ones only
    main(["configs", "--config-dir", str(tmp_path), "model=mine"])
    assert capsys.readouterr().out == mine.read_text()
    assert "mine" in train_help(str(tmp_path)).split("Keys (")[0]


@pytest.mark.parametrize(("args", "expected"), [
    (["modle"], ["Unknown config group 'modle'.", "Did you mean 'model'?", "Valid groups: model, optim, schedule",
                 "preset, hydra/launcher, hydra/sweeper"]),
    (["model=gpt_smal"], ["Unknown option 'gpt_smal' for config group 'model'.", "Did you mean 'gpt_small'?",
                          "Valid options: gpt2, gpt2_medium, gpt_small, gpt_tiny"]),
    (["presets=stable"], ["Unknown config group 'presets'.", "Did you mean 'preset'?"]),
    (["model.n_layer"], ["Unknown config group 'model.n_layer'.", "is a key or a section of keys, not a group",
                         "llmtrain train --help"]),
    (["report"], ["Unknown config group 'report'.", "is a key or a section of keys", "report.*"]),
])
def test_unknown_group_or_option_is_one_paragraph(args: list[str], expected: list[str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["configs", *args])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("llmtrain: error: ") and err.count("\n") == 1
    for text in expected:
        assert text in err


def test_a_bad_argument_prints_nothing_of_the_good_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["configs", "model=gpt_small", "nosuch"])
    out, err = capsys.readouterr()
    assert out == "" and "Unknown config group 'nosuch'" in err


def test_train_help_lists_the_same_options(capsys: pytest.CaptureFixture[str]) -> None:
    text = train_help()
    section = text.split("Config groups (default marked *")[1].split("\n\n")[0].splitlines()[1:]
    listed = {line.split()[0]: line.split(None, 1)[1].split(", ") for line in section}
    expected = {g.name: [f"{o.name}{'*' if o.is_default else ''}" for o in g.options] for g in catalog(CONF)}
    assert listed == expected
    assert "llmtrain configs" in text and "optim.lr" in text  # the keys are still there


def test_configs_is_a_command_that_imports_neither_hydra_nor_torch(tmp_path: Path) -> None:
    assert "configs" in COMMANDS
    code = ("import sys\nfrom llmtrain.cli import main\nmain(['configs'])\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'hydra', 'omegaconf', 'numpy'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert "gpt_tiny*" in out and out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(("line", "expected"), [
    ("llmtrain conf", {"configs"}),
    ("llmtrain configs model=gpt_", {"model=gpt_small", "model=gpt_tiny"}),
    ("llmtrain configs pres", {"preset", "preset=debug_overfit", "preset=fast", "preset=memory_saver",
                               "preset=reproducible", "preset=stable"}),
    ("llmtrain configs -cd ", set()),  # a folder: the shell's own completion
])
def test_shell_completion_of_configs(line: str, expected: set[str], monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COMP_LINE", line)
    monkeypatch.setenv("COMP_POINT", str(len(line)))
    complete(["-sc", "query=bash"], COMMANDS)
    assert set(capsys.readouterr().out.split()) == expected


def test_a_broken_file_of_the_users_is_listed_not_fatal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "broken.yaml").write_text("name: [bad\n")
    (tmp_path / "model" / "odd.yaml").write_text("# Odd heads.\nn_head: x\n")
    out = flat(run(capsys, "-cd", str(tmp_path), "model"))
    assert "broken (not valid YAML: " in out and "odd Odd heads. (yours: " in out  # no count for a shape it cannot read


@pytest.mark.parametrize("args", [["configs"], ["train", "--help"], ["--help"]])
def test_a_closed_pipe_ends_the_listing_quietly(args: list[str], tmp_path: Path) -> None:
    """`llmtrain configs | head`: the reader leaves early; no traceback (the pipe is closed here
    before the command writes, so its first write fails)."""
    proc = subprocess.Popen([sys.executable, "-m", "llmtrain", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 1 and err == ""
