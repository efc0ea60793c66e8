"""The openai client against the server: n choices from one prefill, best_of, logit_bias, lists of
prompts, echo with prompt logprobs, GET /v1/models/{id}."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from iterserve import SamplingParams
from tests.server.conftest import API_KEY, MODEL, ServerThread, wait_until_idle

PROMPT = "The capital of France is"


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_n_choices_share_one_prefill(server, trace_path):
    wait_until_idle(server)
    first_line = len(trace_path.read_text().splitlines())
    r = client(server).completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=6, temperature=1.0, seed=4,
                                          extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.text for c in r.choices) and r.usage.completion_tokens == 18
    wait_until_idle(server)
    steps = [json.loads(line) for line in trace_path.read_text().splitlines()[first_line:]]
    steps = [s for s in steps if s["type"] == "step" and any(rid == r.id for rid, *_ in s["seqs"])]
    prefill = [(n, s) for s in steps for rid, kind, n, *_ in s["seqs"] if rid == r.id and kind == "prefill"]
    assert sum(n for n, _ in prefill) == r.usage.prompt_tokens  # the prompt ran through the model once
    (_, prefill_step), = prefill
    assert prefill_step["kv_blocks_used"] == -(-r.usage.prompt_tokens // 16)  # three sequences, one prompt's blocks
    assert steps[1]["num_decode_seqs"] == 3


def test_n_chat_and_streaming_deltas_per_choice(server):
    chat = [{"role": "user", "content": "Say a word."}]
    r = client(server).chat.completions.create(model=MODEL, messages=chat, n=2, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: identical, as in vLLM
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in client(server).completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=6, temperature=1.0,
                                                   seed=9, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    whole = client(server).completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=6, temperature=1.0, seed=9)
    assert {c.index: c.text for c in whole.choices} == texts  # seeded: streamed or not, the same choices


def test_best_of(server, reference):
    params = dict(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    ranked = sorted(reference.generate(PROMPT, SamplingParams(n=4, logprobs=0, **params))[0].outputs,
                    key=lambda c: c.cumulative_logprob, reverse=True)
    r = client(server).completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=4, max_tokens=6, temperature=1.0,
                                          seed=5, extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [c.text for c in ranked[:2]]


def test_best_of_usage_counts_every_candidate(server):
    """The two discarded candidates were generated too: completion_tokens bills all four (as OpenAI does)."""
    r = client(server).completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=4, max_tokens=6, temperature=1.0,
                                          seed=5, extra_body={"ignore_eos": True})
    assert len(r.choices) == 2
    assert r.usage.completion_tokens == 4 * 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24


def _own_early_stop(choices) -> tuple[int, str]:
    """(choice, stop string): two tokens one choice writes early on and no other choice writes."""
    texts = [ch.text for ch in choices]
    for ch in choices:
        tokens = ch.logprobs.tokens
        for k in range(1, 4):
            stop = "".join(tokens[k:k + 2])
            if (len(stop.strip()) >= 3 and stop not in "".join(tokens[:k + 1])
                    and not any(stop in t for i, t in enumerate(texts) if i != ch.index)):
                return ch.index, stop
    raise AssertionError(f"no choice has a stop string of its own early: {texts}")


def test_a_choice_ended_by_a_stop_string_leaves_the_batch(server, trace_path):
    """n=3: the choice that writes the stop string stops being computed; the other two run to max_tokens."""
    c = client(server)
    common = dict(model=MODEL, prompt=PROMPT, n=3, max_tokens=12, temperature=1.0, seed=2, logprobs=0,
                  extra_body={"ignore_eos": True})
    free = c.completions.create(**common)
    stopper, stop = _own_early_stop(free.choices)
    wait_until_idle(server)
    first_line = len(trace_path.read_text().splitlines())
    r = c.completions.create(stop=[stop], **common)
    choices = {ch.index: ch for ch in r.choices}
    assert choices[stopper].finish_reason == "stop" and len(choices[stopper].logprobs.tokens) < 5
    assert [ch.finish_reason for i, ch in sorted(choices.items()) if i != stopper] == ["length", "length"]
    assert all(len(ch.logprobs.tokens) == 12 for i, ch in choices.items() if i != stopper)
    wait_until_idle(server)
    steps = [json.loads(line) for line in trace_path.read_text().splitlines()[first_line:]]
    rows = [[row for row in s["seqs"] if row[0] == r.id] for s in steps if s["type"] == "step"]
    rows = [rs for rs in rows if rs]
    # the core hears of the stop a step or two late at most, then decodes the other two alone
    assert sum(len(rs) == 3 for rs in rows) <= 7 and len(rows[-1]) == 2
    assert max(row[4] for rs in rows for row in rs) == 12


def test_logit_bias_bans_a_token(server):
    c = client(server)
    greedy = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    token = greedy.choices[0].logprobs.tokens[0]
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as h:
        (token_id,) = h.post("/tokenize", json={"prompt": token, "add_special_tokens": False}).json()["tokens"]
    banned = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0,
                                  logit_bias={str(token_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != token


def test_list_of_prompts_gives_a_choice_each(server, reference):
    prompts = [PROMPT, "One, two,", "Hello", "The sky is"]
    params = SamplingParams(temperature=0, max_tokens=4)
    expected = [o.outputs[0].text for o in reference.generate(prompts, params)]
    r = client(server).completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == expected
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in reference.generate(prompts, params))
    streamed = {i: "" for i in range(8)}
    for chunk in client(server).completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4, temperature=0,
                                                   stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(8)] == [t for t in expected for _ in range(2)]  # prompt i: 2i and 2i + 1


def test_echo_with_logprobs_returns_prompt_logprobs(server, reference):
    r = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1,
                                          echo=True)
    choice = r.choices[0]
    lp = choice.logprobs
    n_prompt = r.usage.prompt_tokens
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == n_prompt + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    expected = reference.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    for j in range(1, n_prompt):
        token = expected.prompt_token_ids[j]
        assert lp.token_logprobs[j] == pytest.approx(expected.prompt_logprobs[j][token].logprob, abs=1e-4)
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    streamed = list(client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                                      logprobs=1, echo=True, stream=True))
    assert [t for ch in streamed for t in ch.choices[0].logprobs.tokens] == lp.tokens
    assert "".join(ch.choices[0].text for ch in streamed) == choice.text


def test_get_model_by_id(server):
    model = client(server).models.retrieve(MODEL)
    assert model.id == MODEL
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("no-such-model")
    r = httpx.get(f"{server.url}/v1/models/no-such-model", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
