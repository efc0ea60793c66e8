"""vLLM's /ping, the browser's /favicon.ico, and /v1/embeddings refused with a reason (through the openai
client)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL


def test_ping_answers_like_health_and_the_favicon_is_no_404(server):
    for method in ("GET", "POST"):  # public, as /health is
        r = httpx.request(method, f"{server.url}/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/favicon.ico").status_code == 204


def test_embeddings_are_refused_naming_the_reason(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="pooling") as info:
        c.embeddings.create(model=MODEL, input="hello")
    assert info.value.body["param"] == "model"
