"""LLM.beam_search with vLLM's names and return type: width 1 is greedy decoding, and a wider search returns
its beams best first, each scored by logprobs a separate forward pass over its tokens confirms."""

from __future__ import annotations

import pytest

from iterserve import LLM, BeamSearchParams, SamplingParams
from iterserve.beam_search import BeamSearchOutput, beam_search_score
from iterserve.errors import SamplingParamsError

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm(smollm) -> LLM:
    return LLM(loaded=smollm, dtype="float32", num_kv_blocks=256, max_model_len=256)


def test_width_one_is_greedy(llm):
    outputs = llm.beam_search([{"prompt": p} for p in PROMPTS], BeamSearchParams(beam_width=1, max_tokens=8))
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, logprobs=0), use_tqdm=False)
    for output, reference in zip(outputs, greedy):
        assert isinstance(output, BeamSearchOutput) and len(output.sequences) == 1
        beam = output.sequences[0]
        assert beam.tokens == reference.prompt_token_ids + reference.outputs[0].token_ids
        assert beam.text == llm.get_tokenizer().decode(beam.tokens)
        assert beam.cum_logprob == pytest.approx(reference.outputs[0].cumulative_logprob, abs=1e-3)


def test_wider_search_is_sorted_and_scored_by_the_model(llm):
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=1.0)
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[0])
    (output,) = llm.beam_search([{"prompt_token_ids": prompt_ids}], params)
    beams = output.sequences
    assert len(beams) == 3 and len({tuple(b.tokens) for b in beams}) == 3
    eos = llm.get_tokenizer().eos_token_id
    scores = [beam_search_score(b.tokens, b.cum_logprob, eos, params.length_penalty) for b in beams]
    assert scores == sorted(scores, reverse=True)
    # the best beam is at least as likely as greedy decoding's sequence of the same length
    greedy = llm.beam_search([{"prompt_token_ids": prompt_ids}], BeamSearchParams(beam_width=1, max_tokens=6))
    assert scores[0] >= beam_search_score(greedy[0].sequences[0].tokens, greedy[0].sequences[0].cum_logprob, eos) - 1e-6
    rescored = llm.generate([{"prompt_token_ids": b.tokens} for b in beams],
                            SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for beam, forward in zip(beams, rescored):
        assert beam.tokens[:len(prompt_ids)] == prompt_ids and len(beam.logprobs) == len(beam.tokens) - len(prompt_ids)
        generated = range(len(prompt_ids), len(beam.tokens))
        total = sum(forward.prompt_logprobs[i][beam.tokens[i]].logprob for i in generated)
        assert beam.cum_logprob == pytest.approx(total, abs=1e-3)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("field, value", [("beam_width", 0), ("beam_width", 11), ("max_tokens", 0),
                                          ("temperature", -1.0), ("length_penalty", float("nan"))])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=field):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, field: value})
