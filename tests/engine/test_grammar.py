"""Structured output below the engine: spec checks, the packed bitmask in the sampler, matchers
compiled against SmolLM2's vocabulary."""

from __future__ import annotations

import json
import re

import pytest
import torch

from iterserve.engine.sampler import Sampler, SamplingRow, apply_token_bitmask, bitmask_words
from iterserve.engine.structured_output import (
    GRAMMAR_STEP_FLOOR_PER_MASK_S,
    GRAMMAR_STEP_MAX_ITEMS,
    GRAMMAR_STEP_STRIKES,
    GrammarBudget,
    GrammarCompiler,
)
from iterserve.models.loader import load_model_info
from iterserve.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from iterserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    _, tokenizer = load_model_info("smollm2-135m")
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size)


def pack(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    bits = torch.zeros(len(allowed), bitmask_words(vocab) * 32, dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        bits[row, list(tokens)] = 1
    words = (bits.view(len(allowed), -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_bitmask_masks_only_the_given_rows():
    vocab = 70  # not a multiple of 32: the last word's spare bits are ignored
    logits = torch.randn(3, vocab)
    before = logits.clone()
    allowed = [{0, 31, 32, 69}, {5}]
    apply_token_bitmask(logits, [0, 2], pack(allowed, vocab))
    for row, tokens in zip((0, 2), allowed):
        kept = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert kept == sorted(tokens)
        assert torch.equal(logits[row, kept], before[row, kept])
    assert torch.equal(logits[1], before[1])


def test_sampler_draws_only_allowed_tokens_and_leaves_neighbours_alone():
    vocab = 100
    logits = torch.randn(2, vocab)
    free = SamplingRow(SamplingParams(temperature=0), [1], [], frozenset())
    mask = pack([{7, 8}], vocab)[0]
    for seed in range(20):
        constrained = SamplingRow(SamplingParams(temperature=1.0, seed=seed), [1], [], frozenset(), allowed_tokens=mask)
        constrained.generator = torch.Generator().manual_seed(seed)
        result = Sampler(torch.Generator().manual_seed(0))(logits.clone(), [free, constrained])
        assert result.token_ids[0] == int(logits[0].argmax())
        assert result.token_ids[1] in (7, 8)


@pytest.mark.parametrize("fields, param", [
    ({"json": "{not json"}, "json"),
    ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "json"),
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
    ({"choice": []}, "choice"),
    ({"json": {"type": "object"}, "regex": "a"}, "structured_outputs"),
    ({}, "structured_outputs"),
])
def test_bad_specs_are_refused_naming_the_field(fields, param):
    with pytest.raises(SamplingParamsError) as e:
        StructuredOutputsParams(**fields)
    assert e.value.param == param


def run(compiler: GrammarCompiler, tokenizer: Tokenizer, spec: StructuredOutputsParams, pick, eos: int = 2,
        limit: int = 200) -> str:
    """Drive a matcher with ``pick(allowed ids)`` until it ends or picks EOS; the text it spelled."""
    matcher = compiler.matcher(spec)
    bitmask = torch.zeros(1, bitmask_words(compiler.vocab_size), dtype=torch.int32)
    ids: list[int] = []
    for _ in range(limit):
        matcher.fill_bitmask(bitmask, 0, {eos})
        logits = torch.zeros(1, compiler.vocab_size)
        apply_token_bitmask(logits, [0], bitmask)
        token = pick(torch.isfinite(logits[0]).nonzero().flatten().tolist())
        if token == eos:
            break
        assert matcher.accept(token)
        ids.append(token)
        if matcher.is_terminated:
            break
    else:
        raise AssertionError("the grammar never ended")
    return tokenizer.decode(ids)


@pytest.mark.parametrize("seed", range(3))
def test_random_walks_stay_inside_the_grammar(compiler, tokenizer, seed):
    rng = torch.Generator().manual_seed(seed)

    def pick(allowed: list[int]) -> int:
        return allowed[int(torch.randint(len(allowed), (1,), generator=rng))]

    choice = run(compiler, tokenizer, StructuredOutputsParams(choice=["red", "green", "blue sky"]), pick)
    assert choice in ("red", "green", "blue sky")
    text = run(compiler, tokenizer, StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), pick)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    value = json.loads(run(compiler, tokenizer, StructuredOutputsParams(json=schema), pick))
    assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool)


def test_eos_is_allowed_only_where_the_grammar_accepts(compiler, tokenizer):
    matcher = compiler.matcher(StructuredOutputsParams(regex=r"ab(cd)?"))
    bitmask = torch.zeros(1, bitmask_words(compiler.vocab_size), dtype=torch.int32)
    eos, other_stop = 2, 0

    def allows(token: int) -> bool:
        return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)

    matcher.fill_bitmask(bitmask, 0, {eos, other_stop})
    assert not allows(eos) and not allows(other_stop)
    for token in tokenizer.encode("ab", add_special_tokens=False):
        assert matcher.accept(token)
    matcher.fill_bitmask(bitmask, 0, {eos, other_stop})
    assert allows(eos) and allows(other_stop) and not matcher.is_terminated


def accepts(compiler, tokenizer, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether ``spec``'s grammar takes ``text`` whole and may end there."""
    matcher = compiler.matcher(spec)
    if not all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)):
        return False
    bitmask = torch.zeros(1, bitmask_words(compiler.vocab_size), dtype=torch.int32)
    eos = tokenizer.eos_token_id
    matcher.fill_bitmask(bitmask, 0, {eos})
    return bool((int(bitmask[0, eos // 32]) >> (eos % 32)) & 1)


OPEN_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                                "where": {"type": "object", "properties": {"x": {"type": "integer"}}}},
               "required": ["city"]}


def test_schemas_allow_only_their_properties_unless_told_otherwise(compiler, tokenizer):
    """A schema that does not say additionalProperties is closed at every level (as vLLM's default backend
    compiles it); disable_additional_properties=False compiles it as written."""
    closed, as_written = StructuredOutputsParams(json=OPEN_SCHEMA), \
        StructuredOutputsParams(json=OPEN_SCHEMA, disable_additional_properties=False)
    assert accepts(compiler, tokenizer, closed, '{"city":"Paris","where":{"x":1}}')
    for extra in ('{"city":"Paris","zip":1}', '{"city":"Paris","where":{"x":1,"y":2}}'):
        assert not accepts(compiler, tokenizer, closed, extra)
        assert accepts(compiler, tokenizer, as_written, extra)
    told = {**OPEN_SCHEMA, "additionalProperties": {"type": "integer"}}  # a schema that says is kept
    assert accepts(compiler, tokenizer, StructuredOutputsParams(json=told), '{"city":"Paris","zip":1}')
    merged = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    assert accepts(compiler, tokenizer, StructuredOutputsParams(json=merged), '{"a":1,"b":2}')


# vLLM's documented example of a GBNF grammar (docs/features/structured_outputs.md)
SIMPLIFIED_SQL_GRAMMAR = """
    root ::= select_statement

    select_statement ::= "SELECT " column " from " table " where " condition

    column ::= "col_1 " | "col_2 "

    table ::= "table_1 " | "table_2 "

    condition ::= column "= " number

    number ::= "1 " | "2 "
"""


def test_gbnf_grammars_compile_like_lark_ones(compiler, tokenizer):
    sql = StructuredOutputsParams(grammar=SIMPLIFIED_SQL_GRAMMAR)
    assert accepts(compiler, tokenizer, sql, "SELECT col_1  from table_2  where col_2 = 1 ")
    assert not accepts(compiler, tokenizer, sql, "SELECT * from users")
    lark = StructuredOutputsParams(grammar='start: "yes" | "no"')
    assert accepts(compiler, tokenizer, lark, "no") and not accepts(compiler, tokenizer, lark, "maybe")
    with pytest.raises(SamplingParamsError, match="grammar"):
        StructuredOutputsParams(grammar="root ::= undefined_rule")


AMBIGUOUS = StructuredOutputsParams(grammar='root ::= x\nx ::= x x | "a" | "b" | x "a" | "a" x\n')


def test_masks_slower_than_the_model_several_steps_running_end_the_request():
    budget = GrammarBudget(start_s=100.0)  # only the per-step cap is tested here
    for _ in range(GRAMMAR_STEP_STRIKES - 1):
        budget.charge_mask(0.5)
        budget.end_step(model_s=0.1)
    assert not budget.exhausted
    budget.charge_mask(0.01)  # one step well within the model's time starts the count again
    budget.end_step(model_s=0.1)
    for _ in range(GRAMMAR_STEP_STRIKES - 1):
        budget.charge_mask(0.5)
        budget.end_step(model_s=0.1)
    assert not budget.exhausted
    budget.charge_mask(0.5)
    budget.end_step(model_s=0.1)
    assert budget.exhausted and "the model's time in" in budget.describe()


def test_many_quick_masks_are_not_held_to_a_fast_model_step():
    budget = GrammarBudget()
    for _ in range(2 * GRAMMAR_STEP_STRIKES):
        for _ in range(64):  # n=64, each mask well under the floor per mask
            budget.charge_mask(GRAMMAR_STEP_FLOOR_PER_MASK_S / 2)
        budget.end_step(model_s=0.001)
    assert budget.strikes == 0


def test_an_ambiguous_grammar_stops_at_the_item_limit_with_a_mask_that_can_still_be_sampled(compiler, tokenizer):
    matcher = compiler.matcher(AMBIGUOUS)
    matcher.budget = GrammarBudget(start_s=1000.0)  # the item limit alone ends it
    bitmask = torch.zeros(1, bitmask_words(compiler.vocab_size), dtype=torch.int32)
    a = tokenizer.encode("a", add_special_tokens=False)[0]
    for _ in range(500):
        matcher.fill_bitmask(bitmask, 0, {2})
        if matcher.failure is not None:
            break
        assert matcher.accept(a)
    failure = matcher.failure
    assert failure is not None and f"limit {GRAMMAR_STEP_MAX_ITEMS}" in failure, failure
    assert bool((bitmask == -1).all())  # every token allowed: the row samples, the scheduler ends the sequence
