"""data=instruct with a Hugging Face folder's chat template: the rendering equals transformers'
apply_chat_template, only the assistant's contents and their end-of-turn tokens are trained on,
a folder without a template keeps llmtrain's own format, prepare shows the first example, a broken
template is refused in one paragraph, and a changed template prepares the data again. Folders are
built here (a byte-level BPE trained on the test corpus, a tiny Llama); nothing downloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtrain.cli import main
from llmtrain.cli.compose import compose_config
from llmtrain.core.errors import ConfigError
from llmtrain.data.cache import chat_template
from llmtrain.data.chat_template import checked, find_template
from llmtrain.data.prepare import prepare_data

from .conftest import TINY_CORPUS

transformers = pytest.importorskip("transformers")

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 3's shape: the BOS from the folder's tokens, a trimmed content, no whitespace between turns
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Block tags with trim_blocks/lstrip_blocks, namespace, tojson, raise_exception and {% generation %}
FANCY = """{% set ns = namespace(system='') %}
{% if messages[0]['role'] == 'system' %}
    {% set ns.system = messages[0]['content'] %}
{% endif %}
{{ bos_token }}{% if ns.system %}[SYS] {{ ns.system | tojson }}
{% endif %}
{% for message in messages if message['role'] != 'system' %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
[USER] {{ message['content'] }}
    {% else %}
[BOT] {% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}

    {% endif %}
{% endfor %}
{% if add_generation_prompt %}[BOT] {% endif %}"""
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "fancy": FANCY}

CONVERSATIONS = [
    [{"role": "user", "content": "Who speaks first?"}, {"role": "assistant", "content": "First Citizen."}],
    [{"role": "system", "content": "Be brief <& \"quoted\">."}, {"role": "user", "content": "Say 4."},
     {"role": "assistant", "content": " 4! "}, {"role": "user", "content": "And 5?"},
     {"role": "assistant", "content": "5, naïvely.\nDone."}],
    [{"role": "user", "content": "Speak, speak."}, {"role": "assistant", "content": "We know't, we know't."},
     {"role": "user", "content": "Let us kill him."}, {"role": "assistant", "content": "No more talking on't."},
     {"role": "user", "content": "One word, good citizens."}, {"role": "assistant", "content": "Away, away!"}],
]


def tokenizer_folder(folder: Path, template: object = None, **settings: object) -> Path:
    """A byte-level BPE with chat special tokens, and tokenizer_config.json holding `template`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "tokenizer.json").exists():
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(SPECIALS), show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tokenizer.train_from_iterator([TINY_CORPUS.read_text()], trainer=trainer)
        tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot_id|>", **settings}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def chats_file(path: Path, conversations: list[list[dict]] = CONVERSATIONS) -> Path:
    lines = [{"messages": c} for c in conversations * 2]
    lines.append({"prompt": "What is 2 plus one?", "response": "It is 3."})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def overrides(folder: Path, data: Path) -> list[str]:
    return ["data=instruct", f"data.path={data}", "data.tokenizer=pretrained", f"data.tokenizer_dir={folder}",
            "device=cpu"]


def trained_runs(tokens: list[int], mask: list[int], decode) -> list[str]:
    """The texts of the runs of trained tokens, special tokens kept."""
    runs, current = [], []
    for token, trained in zip(tokens, mask):
        if trained:
            current.append(token)
        elif current:
            runs.append(decode(current))
            current = []
    return runs + ([decode(current)] if current else [])


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_rendering_equals_transformers(tmp_path: Path, name: str) -> None:
    folder = tokenizer_folder(tmp_path / "tok", TEMPLATES[name])
    ours = checked(find_template(folder, list(SPECIALS)), str(folder))
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    for messages in CONVERSATIONS:
        assert ours.render(messages) == reference.apply_chat_template(messages, tokenize=False)
        for generation_prompt in (True, False):
            assert ours.render(messages[:-1], add_generation_prompt=generation_prompt) == \
                reference.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=generation_prompt)
        assert "".join(text for text, _ in ours.segments(messages)) == ours.render(messages)


def test_named_templates_and_the_jinja_file(tmp_path: Path) -> None:
    """A list of named templates: "default" is used; chat_template.jinja comes before tokenizer_config.json."""
    folder = tokenizer_folder(tmp_path / "tok", [{"name": "tool_use", "template": "{{ 'tools' }}"},
                                                 {"name": "default", "template": CHATML}])
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    ours = find_template(folder, list(SPECIALS))
    assert ours.render(CONVERSATIONS[1]) == reference.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    (folder / "chat_template.jinja").write_text(LLAMA3)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    ours = find_template(folder, list(SPECIALS))
    assert ours.where.endswith("chat_template.jinja")
    assert ours.render(CONVERSATIONS[1]) == reference.apply_chat_template(CONVERSATIONS[1], tokenize=False)


@pytest.mark.parametrize(("name", "end"), [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>"), ("fancy", "<|eot_id|>")])
def test_only_the_assistant_contents_and_their_end_tokens_are_trained(tmp_path: Path, name: str, end: str) -> None:
    from tokenizers import Tokenizer

    folder = tokenizer_folder(tmp_path / "tok", TEMPLATES[name])
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    plain = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cfg = compose_config(overrides(folder, chats_file(tmp_path / "chats.jsonl")))
    data = prepare_data(cfg.data, log=lambda _: None)
    assert data.meta["chat_template"]["sha256"] and data.meta["loss_mask"]
    expected_examples = {tuple(reference.apply_chat_template(c, tokenize=True, return_dict=False)): c
                         for c in CONVERSATIONS}
    pair = [{"role": "user", "content": "What is 2 plus one?"}, {"role": "assistant", "content": "It is 3."}]
    expected_examples[tuple(reference.apply_chat_template(pair, tokenize=True, return_dict=False))] = pair
    seen = 0
    for split in ("train", "val"):
        tokens, mask, offsets = data.tokens(split), data.loss_mask(split), data.offsets(split)
        for start, stop in zip(offsets[:-1], offsets[1:]):
            ids = [int(t) for t in tokens[start:stop]]
            messages = expected_examples[tuple(ids)]  # every example is exactly transformers' tokens
            runs = trained_runs(ids, [int(m) for m in mask[start:stop]],
                                lambda t: plain.decode(t, skip_special_tokens=False))
            contents = [m["content"].strip() if name == "llama3" else m["content"]
                        for m in messages if m["role"] == "assistant"]
            # a token that straddles the start ("[BOT] It" -> " It") is trained whole, as in transformers' mask
            assert len(runs) == len(contents)
            for run, content in zip(runs, contents):
                assert run.endswith(content + end) and not run[: -len(content + end)].strip(), (run, content)
            if name != "fancy":  # these templates start the content on a token boundary
                assert runs == [content + end for content in contents]
            seen += 1
    assert seen == 7


def test_init_from_a_llama_folder_uses_its_template(tmp_path: Path) -> None:
    """model.init_from sets the folder's tokenizer, and with it the template."""
    from tokenizers import Tokenizer

    folder = tokenizer_folder(tmp_path / "llama", CHATML)
    eos = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("<|im_end|>")
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                                      intermediate_size=64, num_hidden_layers=1, max_position_embeddings=128,
                                      vocab_size=400, eos_token_id=eos)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    cfg = compose_config([f"model.init_from={folder}", "data=instruct",
                          f"data.path={chats_file(tmp_path / 'chats.jsonl')}", "device=cpu"])
    assert chat_template(cfg.data) is not None
    data = prepare_data(cfg.data, log=lambda _: None)
    first = data.tokenizer().inner.decode([int(t) for t in data.tokens("train")[: data.offsets("train")[1]]],
                                          skip_special_tokens=False)
    assert first.startswith("<|im_start|>user\n") and first.endswith("<|im_end|>\n")


def test_without_a_template_the_format_is_llmtrains_own(tmp_path: Path) -> None:
    folder = tokenizer_folder(tmp_path / "tok")  # tokenizer_config.json without chat_template
    cfg = compose_config(overrides(folder, chats_file(tmp_path / "chats.jsonl")))
    assert chat_template(cfg.data) is None
    data = prepare_data(cfg.data, log=lambda _: None)
    tokenizer = data.tokenizer()
    text = tokenizer.inner.decode([int(t) for t in data.tokens("train")], skip_special_tokens=False)
    assert "<|user|>\n" in text and "<|assistant|>\n" in text and "<|im_start|>" not in text
    assert "chat_template" not in data.meta


def test_prepare_shows_the_first_example(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tokenizer_folder(tmp_path / "tok", CHATML)
    args = ["prepare", *overrides(folder, chats_file(tmp_path / "chats.jsonl"))]
    main(args)
    built = capsys.readouterr().out
    assert "the first example as the model sees it" in built and str(folder) in built
    assert "<|im_start|>user\n    Who speaks first?<|im_end|>" in built
    assert "<|im_start|>assistant\n    »First Citizen.<|im_end|>«" in built
    main(args)  # reused from the cache: shown all the same
    reused = capsys.readouterr().out
    assert "reused the" in reused and "»First Citizen.<|im_end|>«" in reused


BROKEN = [
    pytest.param("{% for message in messages %}{{ message['content'] }", "is not valid Jinja (line 1",
                 id="syntax-error"),
    pytest.param("{{ raise_exception('This model does not chat.') }}",
                 "the template raised TemplateError: This model does not chat.", id="raises"),
    pytest.param("{% for message in messages if message['role'] == 'user' %}{{ message['content'] }}{% endfor %}",
                 "message 2 (assistant) is not in what the template renders for it", id="drops-the-assistant"),
    pytest.param("{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
                 "is not a prefix", id="not-prefix-stable"),
    pytest.param("{{ ''.__class__.__mro__ }}", "the template raised SecurityError", id="sandbox-escape"),
]


@pytest.mark.parametrize(("template", "problem"), BROKEN)
def test_a_broken_template_is_refused_in_one_paragraph(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                       template: str, problem: str) -> None:
    folder = tokenizer_folder(tmp_path / "tok", template)
    with pytest.raises(SystemExit) as exited:
        main(["prepare", *overrides(folder, chats_file(tmp_path / "chats.jsonl"))])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert message.startswith("llmtrain: error: The chat template of ") and str(folder) in message
    assert problem in message, message


def test_a_conversation_the_template_refuses_names_its_line(tmp_path: Path) -> None:
    """The probe passes (user/assistant alternate); a line whose roles do not is named with the template's message."""
    folder = tokenizer_folder(tmp_path / "tok", FANCY)
    bad = [{"role": "user", "content": "One."}, {"role": "user", "content": "Two."},
           {"role": "assistant", "content": "Three."}]
    path = chats_file(tmp_path / "chats.jsonl", [*CONVERSATIONS, bad])
    with pytest.raises(ConfigError, match=r"chats\.jsonl:4: the template raised TemplateError: Conversation roles"):
        prepare_data(compose_config(overrides(folder, path)).data, log=lambda _: None)


def test_a_changed_template_prepares_the_data_again(tmp_path: Path) -> None:
    folder = tokenizer_folder(tmp_path / "tok", CHATML)
    cfg_args = overrides(folder, chats_file(tmp_path / "chats.jsonl"))
    first = prepare_data(compose_config(cfg_args).data, log=lambda _: None)
    again = prepare_data(compose_config(cfg_args).data, log=lambda _: None)
    assert again.directory == first.directory and not again.built
    tokenizer_folder(folder, LLAMA3)
    second = prepare_data(compose_config(cfg_args).data, log=lambda _: None)
    assert second.directory != first.directory and second.built
    assert second.meta["chat_template"]["sha256"] != first.meta["chat_template"]["sha256"]
    tokenizer_folder(folder, LLAMA3, bos_token="<|endoftext|>")  # the tokens the template is given count too
    third = prepare_data(compose_config(cfg_args).data, log=lambda _: None)
    assert third.directory not in (first.directory, second.directory)
