"""LangChain's ChatOpenAI against the server, as its users write it: structured output through a forced
function call or a JSON schema, both with pydantic models whose schemas say nothing of
additionalProperties."""

from __future__ import annotations

import langchain_openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import API_KEY, MODEL, ServerThread


class City(BaseModel):
    """A city and the country it is in (non-empty, so a grammar that ends early is seen)."""

    name: str = Field(min_length=1, max_length=24)
    country: str = Field(min_length=1, max_length=24)


def chat_model(server: ServerThread, **kw) -> langchain_openai.ChatOpenAI:
    kw = {"temperature": 1.0, "max_tokens": 80, **kw}
    return langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                       timeout=300, **kw)


@pytest.mark.parametrize(("method", "seed"), [("function_calling", 0), ("function_calling", 1),
                                            ("function_calling", 2), ("function_calling", 3), ("json_schema", 0)])
def test_with_structured_output(server, method, seed):
    llm = chat_model(server, seed=seed).with_structured_output(City, method=method)
    city = llm.invoke("Name a large city in Japan, and any facts you know about it.")
    assert isinstance(city, City) and city.name and city.country


def test_responses_api_invoke(server):
    """``use_responses_api=True`` sends /v1/responses: message items in, output items read back."""
    llm = chat_model(server, use_responses_api=True, temperature=0)
    reply = llm.invoke("What is the capital of France?")
    assert reply.text and reply.usage_metadata["output_tokens"] > 0
    assert reply.response_metadata["id"].startswith("resp_")
    chunks = list(llm.stream("What is the capital of France?"))
    assert "".join(chunk.text for chunk in chunks) == reply.text


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_responses_api_structured_output(server, method):
    """A forced function call (tool_choice naming it) or text.format json_schema, over /v1/responses."""
    llm = chat_model(server, use_responses_api=True, temperature=0).with_structured_output(City, method=method)
    city = llm.invoke("Name a large city in Japan, and any facts you know about it.")
    assert isinstance(city, City) and city.name and city.country
