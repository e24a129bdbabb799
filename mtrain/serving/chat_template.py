"""The tokenizer's chat template: found beside its files, rendered by Jinja2's sandbox (a template is part of an
untrusted checkpoint: it can reach no attribute or function beyond the variables given to it).

Where Hugging Face keeps it, first found wins: chat_template.jinja, tokenizer_config.json's "chat_template" (a
string, or a list of {"name", "template"} where "default" is used), chat_template.json's "chat_template".
Variables: messages, add_generation_prompt (true), bos_token, eos_token, and as in transformers the functions
raise_exception(message) and strftime_now(format) (today's date, which Llama 3.1's template prints).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from mtrain.data.tokenizer import Tokenizer
from mtrain.errors import TrainError
from mtrain.serving.fields import BadRequest

MAX_TEMPLATE_BYTES = 1 << 20


class ChatTemplate:
    def __init__(self, source: str, where: Path, special: dict[str, str]):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(str(fmt))
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise TrainError(f"{where}: the chat template does not parse ({e})") from None
        self.where, self.special = where, special

    def render(self, messages: list[dict[str, str]]) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except BadRequest:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise BadRequest(f"the model's chat template ({self.where}) failed on these messages: "
                             f"{type(e).__name__}: {e}", "messages") from None


def find_chat_template(tokenizer: Tokenizer) -> ChatTemplate | None:
    """The template of `tokenizer`'s directory, or None when it has none."""
    directory = _directory(tokenizer)
    config = _json(directory / "tokenizer_config.json")
    special = special_tokens(tokenizer)
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return ChatTemplate(_read(jinja), jinja, special)
    for file in (directory / "tokenizer_config.json", directory / "chat_template.json"):
        template = (config if file.name == "tokenizer_config.json" else _json(file)).get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None:
            if not isinstance(template, str):
                raise TrainError(f'{file}: "chat_template" must be a string or a list of named templates')
            return ChatTemplate(template, file, special)
    return None


def special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """The text of the tokenizer's bos_token and eos_token ("" for one it does not name)."""
    config = _json(_directory(tokenizer) / "tokenizer_config.json")
    return {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}


def _directory(tokenizer: Tokenizer) -> Path:
    return tokenizer.path if tokenizer.path.is_dir() else tokenizer.path.parent


def _read(file: Path) -> str:
    if file.stat().st_size > MAX_TEMPLATE_BYTES:
        raise TrainError(f"{file} is larger than {MAX_TEMPLATE_BYTES} bytes: not a chat template")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TrainError(f"{file} is not UTF-8 text") from None


def _json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(_read(file))
    except json.JSONDecodeError as e:
        raise TrainError(f"{file} is not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise TrainError(f"{file} must hold a JSON object")
    return data


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _raise(message: Any):
    raise BadRequest(f"the model's chat template refused these messages: {message}", "messages")
