"""Render a GGUF's Jinja chat template the way Hugging Face transformers does."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template failed to parse or raised while rendering (e.g. via raise_exception)."""


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers overrides jinja's tojson so non-ASCII text is not escaped.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **kwargs) -> str:
    """Render `messages` ([{'role': ..., 'content': ...}, ...]) with a Jinja chat template.

    Extra keyword arguments (e.g. tools, date_string) are passed to the template as variables.
    """
    try:
        compiled = _compile(template)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **kwargs)
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from exc
