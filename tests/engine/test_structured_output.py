"""Structured output through the offline engine on SmolLM2-135M: vLLM's SamplingParams shape,
outputs that parse, and unconstrained neighbours in the same batch decoding exactly as alone."""

from __future__ import annotations

import json
import logging

import pytest

from iterserve import LLM, SamplingParams
from iterserve.sampling_params import StructuredOutputsParams
from tests.conftest import CHAT_PROMPTS

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 10**9}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(smollm) -> LLM:
    return LLM(loaded=smollm, dtype="float32", num_kv_blocks=256, max_model_len=1024)


def chat_ids(llm: LLM, conversation: list[dict]) -> list[int]:
    tokenizer = llm.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template(conversation), add_special_tokens=False)


def test_generate_with_structured_outputs(llm):
    ask = [{"role": "user", "content": "Give a city and its population as JSON."}]
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=96,
                       structured_outputs=StructuredOutputsParams(json=SCHEMA))
        for seed in range(4)
    ] + [SamplingParams(temperature=1.0, seed=9, max_tokens=8,
                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))]
    outs = llm.generate([chat_ids(llm, ask)] * 5, params)
    for out in outs[:4]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        value = json.loads(out.outputs[0].text)
        assert set(value) == {"city", "population"}
        assert isinstance(value["city"], str) and len(value["city"]) <= 20
        assert isinstance(value["population"], int) and 0 <= value["population"] <= 10**9
    assert outs[4].outputs[0].text in ("yes", "no")
    assert llm.engine.block_manager.num_used_blocks == 0


def test_greedy_neighbours_are_unchanged_by_a_constrained_request(llm):
    prompts = [chat_ids(llm, c) for c in CHAT_PROMPTS[:3]]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate(prompts, greedy)
    constrained = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    mixed = llm.generate(prompts + [prompts[0]], [greedy] * 3 + [constrained])
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    assert mixed[3].outputs[0].token_ids != alone[0].outputs[0].token_ids  # the grammar did act on its row
    assert mixed[3].outputs[0].text.startswith('{"city":"')



@pytest.mark.parametrize("best_of", [None, 4])
def test_n_choices_each_follow_the_grammar(llm, best_of):
    """Each of n (or best_of) sequences advances its own matcher: with one shared, a sibling's token would
    move the others' grammar, and their JSON would not parse."""
    ask = [{"role": "user", "content": "Give a city and its population as JSON."}]
    params = SamplingParams(n=3, best_of=best_of, temperature=1.0, seed=5, max_tokens=96,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    choices = llm.generate(chat_ids(llm, ask), params)[0].outputs
    assert len(choices) == 3
    for choice in choices:
        assert choice.finish_reason == "stop", choice.text
        value = json.loads(choice.text)
        assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    assert len({c.text for c in choices}) > 1  # temperature 1 sampled different documents
    assert llm.engine.block_manager.num_used_blocks == 0


def test_an_ambiguous_grammar_ends_at_its_time_budget_and_its_neighbour_is_unchanged(llm, caplog):
    """Each token of an ambiguous grammar costs more than the last; past the request's budget of grammar
    time it ends with an error rather than slowing the batch further."""
    ambiguous = StructuredOutputsParams(grammar='root ::= x\nx ::= x x | "a" | "b" | x "a" | "a" x\n')
    plain = SamplingParams(temperature=0, max_tokens=24)
    prompt = chat_ids(llm, CHAT_PROMPTS[1])
    alone = llm.generate([prompt], plain)[0].outputs[0].token_ids
    with caplog.at_level(logging.WARNING, logger="iterserve.engine.scheduler"):
        outs = llm.generate([prompt, prompt], [SamplingParams(
            temperature=1.0, seed=0, n=2, max_tokens=600, ignore_eos=True, structured_outputs=ambiguous), plain])
    assert any("make it unambiguous" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    for c in outs[0].outputs:
        assert c.finish_reason == "error" and len(c.token_ids) < 600, (c.finish_reason, len(c.token_ids))
    assert outs[1].outputs[0].token_ids == alone
    assert llm.engine.block_manager.num_used_blocks == 0
