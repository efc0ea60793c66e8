"""Sampled outputs keep the target distribution under speculation: thousands of draws from a model with
an 8-token vocabulary, against the exact probabilities of every 3-token continuation computed from the
model's own logits, by a chi-square test.

The model's LM head is its embedding shifted by one row, so token t mostly predicts t + 1: every
position's distribution differs from its neighbours', and a draft verified against the wrong
position's logits would shift the counts far beyond the test's tolerance."""

from __future__ import annotations

import itertools

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.attention import AttentionMetadata
from iterserve.attention.reference import ReferenceBackend
from iterserve.models.linear import dense_chooser
from iterserve.models.loader import load_model

VOCAB = 8
TINY = (f"random:smollm2-135m?num_layers=2&vocab_size={VOCAB}&hidden_size=64&intermediate_size=128&num_heads=4"
        "&num_kv_heads=2&head_dim=16")
PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2]  # counts up, as the model does: n-gram lookup finds drafts
TEMPERATURE = 0.5  # peaked enough that drafts are often accepted, flat enough that they are often not
NUM_DRAWS = 3000  # 25 requests of n = GROUP
GROUP = 120
LENGTH = 4  # the first token comes from the prefill; drafts cover tokens 2-4


@pytest.fixture(scope="module")
def tiny():
    # F.linear on the plain weights: a method that packs its own copy at load would keep the tied head below
    loaded = load_model(TINY, dtype="float32", device="cpu", seed=0, linear=dense_chooser)
    embed = loaded.model.embed_tokens.weight
    loaded.model.lm_head.weight = torch.nn.Parameter(embed.detach().roll(1, dims=0).clone())  # unties the head
    return loaded


def exact_distribution(loaded) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) = p(t1 | prompt) p(t2 | prompt, t1) p(t3 | prompt, t1, t2), at the sampling temperature."""
    model = loaded.model
    probs: dict[tuple[int, ...], float] = {}
    for t1, t2 in itertools.product(range(VOCAB), repeat=2):
        ids = [*PROMPT, t1, t2]
        meta = AttentionMetadata.build(block_size=16, block_tables=[[0]], num_cached=[0], query_lens=[len(ids)])
        with torch.inference_mode():
            logits = model(torch.tensor(ids), torch.arange(len(ids)), model.allocate_kv_cache(1, 16), meta,
                           ReferenceBackend())
        p = torch.softmax(logits[-3:].double() / TEMPERATURE, dim=-1)
        for t3 in range(VOCAB):
            probs[(t1, t2, t3)] = float(p[0, t1] * p[1, t2] * p[2, t3])
    return probs


def chi_square_p(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float], n: int) -> float:
    """Pearson's test; cells expected fewer than 5 times are pooled into one, as the test requires."""
    cells = sorted(probs, key=probs.get, reverse=True)
    observed, expected = [], []
    pooled_o, pooled_e = 0.0, 0.0
    for c in cells:
        if probs[c] * n >= 5:
            observed.append(counts.get(c, 0))
            expected.append(probs[c] * n)
        else:
            pooled_o += counts.get(c, 0)
            pooled_e += probs[c] * n
    observed.append(pooled_o)
    expected.append(pooled_e)
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    stat = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((len(e) - 1) / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("spec, acceptance", [
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}, (0.2, 0.9)),
    # the random model with its head still tied mostly repeats a token: its drafts are mostly rejected
    ({"model": TINY, "num_speculative_tokens": 3}, (0.01, 0.5)),
], ids=["ngram", "draft"])
def test_sampled_outputs_keep_the_target_distribution(tiny, spec, acceptance):
    llm = LLM(loaded=tiny, num_kv_blocks=2048, max_num_seqs=256, seed=3,
              speculative_config={**spec, "disable_by_batch_size": None})  # speculate in every batch
    # n sequences per request share one prefill and sample their first tokens independently
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=LENGTH, ignore_eos=True, n=GROUP)
    outputs = [c for o in llm.generate([PROMPT] * (NUM_DRAWS // GROUP), params, use_tqdm=False) for c in o.outputs]
    stats = llm.engine.core.spec_stats
    low, high = acceptance
    assert low < stats.num_accepted_tokens / stats.num_draft_tokens < high  # both branches ran
    assert len(stats.accepted_per_pos) >= 2  # second drafts were accepted too
    counts: dict[tuple[int, ...], int] = {}
    for o in outputs:
        key = tuple(o.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_p(counts, exact_distribution(tiny), NUM_DRAWS) > 1e-3
