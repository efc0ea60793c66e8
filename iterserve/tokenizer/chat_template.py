"""Chat templates rendered with jinja2 the way transformers renders them: the conversation's shape checked,
then the template compiled in a sandbox with transformers' filters and globals."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the conversation's shape and return plain dicts with string content.

    Templates index message['content'] as a string, so a list of text parts (OpenAI's format) is
    joined with newlines. Keys whose value is None are dropped, as transformers does, because
    templates test for a key's presence rather than for None.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"messages[{index}] must be a dict with 'role' and 'content', got {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{index}] needs a non-empty string 'role'")
        content = message.get("content")
        if content is None:
            if not message.get("tool_calls"):
                raise ValueError(f"messages[{index}] needs 'content' (a string or a list of text parts)")
        elif isinstance(content, list):
            content = "\n".join(_text_part(part, index) for part in content)
        elif not isinstance(content, str):
            raise ValueError(
                f"messages[{index}]['content'] must be a string or a list of text parts, got {type(content).__name__}"
            )
        out = {key: value for key, value in message.items() if value is not None}
        if content is not None:
            out["content"] = content
        normalized.append(out)
    return normalized


def _text_part(part: Any, index: int) -> str:
    if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise ValueError(
            f"messages[{index}]['content'] has an unsupported part {part!r}; "
            "only {'type': 'text', 'text': str} parts are accepted"
        )
    return part["text"]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses; templates come with model
    files and are untrusted, hence the sandbox."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template does not compile: {exc}") from exc


def load_chat_template(value: str) -> str:
    """A chat template given as a file or as the template itself (vLLM's ``--chat-template``): a path that
    exists is read; text with a template's braces is the template; anything else is a missing file."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise FileNotFoundError(f"--chat-template: no such file {value!r} (and it is not a template)")
