"""The transformers tokenizer `LLM.get_tokenizer()` hands out: the same ids, special tokens and chat prompts as
iterserve's own tokenizer, and the methods vLLM scripts call on it."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import PreTrainedTokenizerFast  # noqa: E402

from iterserve.tokenizer import Tokenizer  # noqa: E402
from iterserve.tokenizer.hf import to_transformers  # noqa: E402
from tests.tokenizer.test_tokenizer import CONVERSATIONS, GGUF_PATH, TEXTS  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "The time <now> & here",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(GGUF_PATH)


@pytest.fixture(scope="module")
def hf(tok) -> PreTrainedTokenizerFast:
    return to_transformers(tok)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_ours(tok, hf, text):
    assert hf.encode(text) == tok.encode(text)
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert hf(text)["input_ids"] == tok.encode(text)
    ids = tok.encode(text)
    assert hf.decode(ids) == tok.decode(ids, skip_special_tokens=False)
    assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)


def test_special_tokens_and_vocabulary(tok, hf):
    assert isinstance(hf, PreTrainedTokenizerFast)
    assert (hf.bos_token, hf.eos_token) == (tok.bos_token, tok.eos_token)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos_token_id, tok.eos_token_id,
                                                                  tok.pad_token_id)
    assert set(hf.all_special_ids) >= {tok.bos_token_id, tok.eos_token_id}
    assert len(hf) == tok.vocab_size
    assert hf.convert_ids_to_tokens([2, 216]) == [tok.id_to_token(2), tok.id_to_token(216)]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_ours(tok, hf, conversation, add_generation_prompt):
    ours = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt) == ours


def test_tool_templates_render_as_ours(tok):
    """A template that lists the tools, and a separate tool_use template, are handed over with the tokenizer."""
    listing = "{{ bos_token }}{% for t in tools %}{{ t | tojson }}\n{% endfor %}{{ messages[-1]['content'] }}"
    own = Tokenizer(tok.backend, special_tokens=tok.special_tokens,
                    chat_templates={"default": "{{ messages[0]['content'] }}", "tool_use": listing})
    hf = to_transformers(own)
    conversation = CONVERSATIONS[1]
    assert hf.apply_chat_template(conversation, tools=TOOLS, chat_template="tool_use", tokenize=False) == \
        own.apply_chat_template(conversation, tools=TOOLS) == \
        f"<|im_start|>{json.dumps(TOOLS[0], ensure_ascii=False)}\nWhat is 2+2?"
    assert hf.apply_chat_template(conversation, tokenize=False) == own.apply_chat_template(conversation)


def test_our_backend_is_not_shared(tok, hf):
    """transformers' padding settings go on its own copy of the pipeline, never on the engine's."""
    hf(["a", "a longer text"], padding=True)
    assert tok.backend.padding is None
