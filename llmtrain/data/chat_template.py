"""A Hugging Face folder's chat template, for data=instruct with the folder's tokenizer
(model.init_from, or data.tokenizer=pretrained).

A chat model expects conversations in its own format (`<|im_start|>user\\n...<|im_end|>`), which
the folder ships as a Jinja template: `chat_template.jinja`, else tokenizer_config.json's
`chat_template`. `ChatTemplate.render` renders it as transformers' `apply_chat_template(messages,
tokenize=False)` does (transformers/utils/chat_template_utils.py): a sandboxed, immutable Jinja
environment with trim_blocks and lstrip_blocks, the same helpers (`raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML, `dict`, a `namespace` without underscore
names, the `{% generation %}` tag) and the folder's named special tokens (`bos_token`,
`eos_token`, ...). jinja2 alone does it: transformers is an optional extra and takes seconds to
import.

Which characters are trained on (`ChatTemplate.segments`): most templates lack `{% generation %}`
markers, so the turns are found by rendering the conversation prefix by prefix: the text
messages[:i+1] adds to messages[:i] is turn i. An assistant turn is trained from where its content
starts (after the generation prompt the template adds for messages[:i], or where the content
appears) through the last special token the template writes after the content (its end of turn:
`<|im_end|>`, `<|eot_id|>`, `</s>`); the whitespace after that token separates turns and is not
trained. Everything else (system and user turns, role headers, the BOS) is masked.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmtrain.core.errors import ConfigError

TEMPLATE_FILE = "chat_template.jinja"  # transformers 4.50+ saves a single template here
# The named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# A conversation every chat template must render: checked before any example is read.
PROBE = [{"role": "user", "content": "Probe question one?"},
         {"role": "assistant", "content": "Probe answer one."},
         {"role": "user", "content": "Probe question two?"},
         {"role": "assistant", "content": "Probe answer two."}]
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers aliases them

Segments = list[tuple[str, bool]]  # (text, trained), together the rendered conversation


class TemplateProblem(Exception):
    """A template that cannot render a conversation, or renders it in a way turns cannot be told apart."""


@dataclass
class ChatTemplate:
    text: str
    where: str  # the file it came from, for messages
    tokens: dict[str, str]  # the named special tokens, as the template sees them
    special: tuple[str, ...]  # the tokenizer's special tokens' text: what can end a turn
    _compiled: Any = field(default=None, repr=False)

    @property
    def sha256(self) -> str:
        """What the rendering depends on: the template and the token strings it is given."""
        identity = json.dumps([self.text, self.tokens], sort_keys=True)
        return hashlib.sha256(identity.encode()).hexdigest()

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as apply_chat_template(messages, tokenize=False) renders it; TemplateProblem
        carries what the template raised."""
        if self._compiled is None:
            self._compiled = compile_template(self.text)
        try:
            return self._compiled.render(messages=[_plain(m) for m in messages], tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.tokens)
        except Exception as err:  # noqa: BLE001 - a template is code: raise_exception, a TypeError, a SecurityError
            raise TemplateProblem(f"the template raised {type(err).__name__}: {_short(str(err))}") from None

    def segments(self, messages: list[dict]) -> Segments:
        """The rendered conversation cut into (text, trained) pieces (module docstring: the rule)."""
        rendered = [""]
        for i in range(1, len(messages) + 1):
            text = self.render(messages[:i])
            if not text.startswith(rendered[-1]):
                raise TemplateProblem(
                    f"rendering messages 1-{i} changes the text of messages 1-{i - 1} (it is not a prefix), so the "
                    "turns cannot be told apart to train on the assistant's only")
            rendered.append(text)
        spans = [self._trained_span(messages, i, rendered[i], rendered[i + 1])
                 for i, m in enumerate(messages) if m["role"] == "assistant"]
        full, out, at = rendered[-1], [], 0
        for start, end in spans:
            out += [(full[at:start], False), (full[start:end], True)]
            at = end
        out.append((full[at:], False))
        return [(text, trained) for text, trained in out if text]

    def _trained_span(self, messages: list[dict], i: int, before: str, after: str) -> tuple[int, int]:
        content = messages[i]["content"].strip()
        start = None
        if i > 0:  # the generation prompt is what the model is given at inference: not trained
            prompt = self.render(messages[:i], add_generation_prompt=True)
            if len(prompt) > len(before) and after.startswith(prompt):
                start = len(prompt)
        if start is None:
            found = after.find(content, len(before)) if content else len(after)
            if found < 0:
                raise TemplateProblem(f"message {i + 1} (assistant) is not in what the template renders for it")
            start = found
        content_end = start
        if content:
            found = after.find(content, start)
            if found < 0:
                raise TemplateProblem(f"message {i + 1} (assistant) is not in what the template renders for it")
            content_end = found + len(content)
        end = max((after.rfind(s) + len(s) for s in self.special if after.rfind(s) >= content_end), default=None)
        return start, end if end is not None else len(after)


def find_template(folder: Path, special_tokens: list[str]) -> ChatTemplate | None:
    """The folder's chat template (chat_template.jinja first, as transformers prefers it; else
    tokenizer_config.json's `chat_template`, a string or a list of named templates, "default" taken),
    with the named special tokens of tokenizer_config.json; None when it has none."""
    from llmtrain.core.hf_files import TOKENIZER_CONFIG
    from llmtrain.core.readers import UnreadableFile, read_json, read_text

    settings: Any = {}
    config_file = folder / TOKENIZER_CONFIG
    try:
        if os.path.lexists(config_file):
            settings = read_json(config_file, "the tokenizer's settings")
        jinja_file = folder / TEMPLATE_FILE
        text, where = (read_text(jinja_file, "a chat template"), str(jinja_file)) if os.path.lexists(jinja_file) \
            else (None, str(config_file))
    except UnreadableFile as err:
        raise ConfigError(f"{err} The folder's chat template cannot be read; the folder is damaged.") from None
    settings = settings if isinstance(settings, dict) else {}
    if text is None:
        text = _configured_template(settings.get("chat_template"), where)
    if text is None:
        return None
    tokens = {}
    for name in NAMED_TOKENS:
        value = settings.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[name] = value
    return ChatTemplate(text, where, tokens, tuple(sorted(set(special_tokens), key=len, reverse=True)))


def _configured_template(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": ..., "template": ...}]: transformers' default is the one named so
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ConfigError(f"{where} has chat templates named {', '.join(sorted(map(str, named)))} but none named "
                          "\"default\", the one transformers and llmtrain use; name one of them \"default\".")
    raise ConfigError(f"{where}'s chat_template is a JSON {type(value).__name__}, not a template (a string) or a "
                      "list of named ones; the folder is damaged.")


def checked(template: ChatTemplate, folder: str) -> ChatTemplate:
    """The template, compiled and tried on a probe conversation: a syntax error, a template that
    raises, or one that renders the conversation without the assistant's text is refused in one
    paragraph naming the folder, before any example is read."""
    try:
        template._compiled = compile_template(template.text)
        template.segments(PROBE)
    except TemplateProblem as err:
        raise ConfigError(refusal(template, folder, str(err), "a plain user/assistant conversation")) from None
    return template


def refusal(template: ChatTemplate, folder: str, problem: str, what: str) -> str:
    return (f"The chat template of {folder} ({template.where}) cannot be used for data=instruct: on {what}, "
            f"{problem}. llmtrain renders each conversation with the folder's template, as transformers' "
            "apply_chat_template does, and trains on the assistant's turns only; fix the template in that file, or "
            "remove it to train in llmtrain's own format (docs/data.md, Instruction data).")


def compile_template(text: str) -> Any:
    """transformers' `_cached_compile_jinja_template`, its environment rebuilt with jinja2 alone."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tag(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace_class()
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as err:
        raise TemplateProblem(f"it is not valid Jinja (line {err.lineno}: {_short(err.message or '')})") from None
    except Exception as err:  # noqa: BLE001 - whatever else the parser raises, said in one line
        raise TemplateProblem(f"it does not compile ({type(err).__name__}: {_short(str(err))})") from None


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which a prompt must keep as they are
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    from datetime import datetime

    return datetime.now().strftime(fmt)


class _TemplateDict:
    # A bare `dict` would hand templates the class itself; this offers only building one
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _namespace_class() -> type:
    import jinja2.utils

    class TemplateNamespace(jinja2.utils.Namespace):
        # Underscore names would reach CPython internals through the namespace object
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    return TemplateNamespace


def _generation_tag() -> type:
    """`{% generation %}...{% endgeneration %}` renders its body: templates that mark the assistant's
    text for transformers' return_assistant_tokens_mask compile and render as there."""
    import jinja2.nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    return Generation


def _plain(message: dict) -> dict:
    """A message as transformers hands it to the template: keys holding null dropped, the reasoning
    under each of the names templates read."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def preview(segments: Segments, limit: int = 1200, max_lines: int = 24) -> str:
    """The first example as the model sees it, the trained text between » and «, cut to about
    `limit` characters and `max_lines` lines (a marker left open by the cut is closed)."""
    out, shown = [], 0
    for text, trained in segments:
        piece = text[: max(0, limit - shown)]
        shown += len(piece)
        out.append(f"»{piece}«" if trained and piece else piece)
        if shown >= limit:
            break
    total = sum(len(text) for text, _ in segments)
    lines = "".join(out).split("\n")
    cut = total > shown or len(lines) > max_lines
    body = "\n".join("    " + line if line else "" for line in lines[:max_lines])
    if body.count("»") > body.count("«"):  # the line cut fell inside a trained span
        body += "«"
    return body + (f"\n    ... ({total:,} characters in all)" if cut else "")
