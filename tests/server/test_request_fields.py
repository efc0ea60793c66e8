"""Explicit nulls and ignored fields in the request models, without a server."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from iterserve.server import request_fields
from iterserve.server.protocol import ChatCompletionRequest, CompletionRequest
from iterserve.server.protocol_responses import ResponsesRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def test_null_means_the_default_and_nullable_fields_keep_null():
    chat = ChatCompletionRequest.model_validate({
        "messages": MESSAGES, "stream": None, "n": None, "logprobs": None, "presence_penalty": None,
        "frequency_penalty": None, "parallel_tool_calls": None, "stream_options": {"include_usage": None}})
    assert (chat.stream, chat.n, chat.logprobs, chat.parallel_tool_calls) == (False, 1, False, True)
    assert chat.presence_penalty == chat.frequency_penalty == 0.0 and chat.stream_options is not None
    assert chat.stream_options.include_usage is False
    completion = CompletionRequest.model_validate({"prompt": "x", "max_tokens": None, "echo": None, "top_k": None})
    assert completion.max_tokens is None and completion.echo is False and completion.top_k == 0
    responses = ResponsesRequest.model_validate({"input": "x", "stream": None, "store": None, "background": None})
    assert (responses.stream, responses.store, responses.background) == (False, True, False)


@pytest.mark.parametrize("body", [{"messages": None}, {"messages": MESSAGES, "n": 1.0},
                                  {"messages": MESSAGES, "n": False}, {"messages": MESSAGES, "top_k": "3"}])
def test_required_fields_and_integer_types_are_still_checked(body):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_each_ignored_name_is_logged_once(caplog):
    request_fields.forget_reported()
    with caplog.at_level(logging.INFO, logger="iterserve.server.protocol"):
        for _ in range(5):
            ChatCompletionRequest.model_validate({"messages": MESSAGES, "no_stop_trim": True, "zz_unknown": 1})
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "zz_unknown": 1, "zz_other": 2})
    messages = [(rec.levelno, rec.getMessage()) for rec in caplog.records]
    assert len(messages) == 3, messages
    assert messages[0][0] == logging.INFO and "no_stop_trim" in messages[0][1]
    assert messages[1][0] == logging.WARNING and "zz_unknown" in messages[1][1]
    assert messages[2][0] == logging.WARNING and "zz_other" in messages[2][1] and "zz_unknown" not in messages[2][1]


def test_remembered_names_are_bounded(monkeypatch):
    request_fields.forget_reported()
    monkeypatch.setattr(request_fields, "MAX_REMEMBERED", 3)
    request_fields.report_ignored([f"f{i}" for i in range(10)])
    assert len(request_fields._seen) == 3
    request_fields.forget_reported()
