"""vLLM's prompt dicts (``vllm.inputs``), for type hints; plain dicts of these shapes work too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict, cast


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt


def parse_prompt(prompt: PromptType) -> str | list[int]:
    """One prompt in any of vLLM's single-prompt shapes -> text or token ids."""
    if isinstance(prompt, Mapping):
        extra = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if extra:
            raise ValueError(f"unsupported prompt field(s) {', '.join(extra)}; use 'prompt' or 'prompt_token_ids'")
        fields = cast(dict[str, Any], prompt)
        if "prompt_token_ids" in fields:
            return list(fields["prompt_token_ids"])
        if "prompt" in fields:
            return fields["prompt"]
        raise ValueError("a prompt dict needs 'prompt' (TextPrompt) or 'prompt_token_ids' (TokensPrompt)")
    if isinstance(prompt, str):
        return prompt
    return list(prompt)
