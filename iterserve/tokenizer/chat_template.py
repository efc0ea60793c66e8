"""Chat templates: the conversation's shape checked, then the template rendered by transformers' renderer
(the one ``PreTrainedTokenizer.apply_chat_template`` uses), so prompts are the model's own."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import jinja2
from transformers.utils.chat_template_utils import render_jinja_template

# render_jinja_template's own arguments, which a template variable of the same name would collide with
_RENDERER_ARGUMENTS = frozenset({"conversations", "messages", "chat_template", "return_assistant_tokens_mask"})


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


def render_chat_template(template: str, messages: list[dict[str, Any]], /, *, add_generation_prompt: bool,
                         continue_final_message: bool, **variables: Any) -> str:
    """Render with transformers' own renderer, so a prompt is the one the model's tokenizer would build: its
    sandbox (templates come with model files, or in a request, and are untrusted), filters, globals,
    ``{% generation %}`` tag and continue_final_message cut. Raises ValueError naming what failed."""
    reserved = sorted(_RENDERER_ARGUMENTS & variables.keys())
    if reserved:
        raise ValueError(f"chat template variable(s) {', '.join(reserved)} cannot be set: the renderer sets them")
    try:
        # annotated as returning str, it returns (prompts, generation indices)
        rendered, _ = cast(tuple[list[str], Any], render_jinja_template(
            [messages], chat_template=template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **variables))
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template failed: {exc}") from exc
    return rendered[0]


def load_chat_template(value: str) -> str:
    """A chat template given as a file or as the template itself (vLLM's ``--chat-template``): a path that
    exists is read; text with a template's braces is the template; anything else is a missing file."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise FileNotFoundError(f"--chat-template: no such file {value!r} (and it is not a template)")
