"""What structured output costs on SmolLM2-135M's 49k vocabulary, measured in one process.

1. Building the grammar engine's tokenizer (once per engine core), checking a spec where the request
   is made, and compiling a matcher in the core (per request).
2. Per generated token: filling the packed bitmask row and applying it to the logits; and the masks of
   random walks (random allowed tokens) through realistic grammars and an ambiguous one, under the
   engine's grammar limits (which of them a limit ends).
3. What one constrained request costs the others in its batch: decode steps of a batch of greedy
   requests, with and without one JSON-constrained request among them, interleaved A/B round by
   round so that load from other processes hits both alike.

    .venv/bin/python scripts/bench_structured_output.py --rounds 5 --batch 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from iterserve.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.sampler import apply_token_bitmask, bitmask_words
from iterserve.engine.structured_output import GrammarCompiler
from iterserve.models.loader import load_model, load_model_info
from iterserve.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["street", "zip"]},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
WALKS = {
    "any JSON object": StructuredOutputsParams(json_object=True),
    "200-property schema": StructuredOutputsParams(json={"type": "object", "properties": {
        f"field_{i}": {"type": ["string", "integer", "array", "null"], "items": {"type": "string"}}
        for i in range(200)}}),
    "the schema above": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=r"(\d{3}-){3}[a-z]+ (yes|no)"),
    "Lark arithmetic": StructuredOutputsParams(grammar='start: expr\nexpr: term (("+"|"-") term)*\n'
                                               'term: factor (("*"|"/") factor)*\nfactor: NUMBER | "(" expr ")"\n'
                                               'NUMBER: /[0-9]+/\n'),
    "ambiguous (issue 49)": StructuredOutputsParams(grammar='root ::= x\nx ::= x x | "a" | "b" | x "a" | "a" x\n'),
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["a", "c"],
            "address": {"street": "12 St James's Square", "zip": "SW1Y 4JH"}}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def grammar_costs(repeats: int) -> None:
    config, tokenizer = load_model_info("smollm2-135m")
    assert tokenizer is not None
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, config.vocab_size)
    print(f"grammar tokenizer for {config.vocab_size} tokens: {ms(time.perf_counter() - start)} (once per core)")
    checks, compiles = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        spec = StructuredOutputsParams(json=SCHEMA)  # checks the spec, as the API side does
        checks.append(time.perf_counter() - start)
        start = time.perf_counter()
        matcher = compiler.matcher(spec)
        compiles.append(time.perf_counter() - start)
    print(f"check a JSON schema (API side): median {ms(statistics.median(checks))}")
    print(f"compile a matcher (core, per request): median {ms(statistics.median(compiles))}")
    ids = tokenizer.encode(json.dumps(INSTANCE, separators=(",", ":")), add_special_tokens=False)
    bitmask = torch.zeros(1, bitmask_words(config.vocab_size), dtype=torch.int32)
    logits = torch.randn(1, config.vocab_size)
    fills, applies = [], []
    for token in ids:
        start = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0, {tokenizer.eos_token_id or 0})
        fills.append(time.perf_counter() - start)
        start = time.perf_counter()
        apply_token_bitmask(logits.clone(), [0], bitmask)
        applies.append(time.perf_counter() - start)
        assert matcher.accept(token), tokenizer.decode([token])
    print(f"per token over a {len(ids)}-token instance: fill mask median {ms(statistics.median(fills))} "
          f"(max {ms(max(fills))}), apply median {ms(statistics.median(applies))}")


def batch_cost(rounds: int, batch: int, tokens: int) -> None:
    loaded = load_model("smollm2-135m", dtype="float32", device="cpu")
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=512, max_model_len=1024), loaded)
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person."}]),
                              add_special_tokens=False)
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json={"type": "object"}))

    def decode_steps(with_grammar: bool) -> list[float]:
        params = [greedy] * batch
        if with_grammar:
            params[-1] = constrained
        for p in params:
            engine.add_request(prompt, p)
        engine.step()  # prefill
        times = []
        while engine.has_unfinished_requests():
            full = engine.num_running == batch
            start = time.perf_counter()
            engine.step()
            if full:  # only steps where the batch is whole count, so A and B compare like for like
                times.append(time.perf_counter() - start)
        return times

    decode_steps(True)  # warm up
    a, b = [], []
    for _ in range(rounds):
        a += decode_steps(False)
        b += decode_steps(True)
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"decode step, {batch} greedy requests: median {ms(ma)} over {len(a)} steps")
    print(f"decode step, {batch - 1} greedy + 1 JSON-constrained: median {ms(mb)} over {len(b)} steps "
          f"({(mb / ma - 1) * 100:+.1f}%)")


def random_walks(steps: int) -> None:
    """Masks along a walk of random allowed tokens through each of WALKS, until it ends or fails."""
    config, tokenizer = load_model_info("smollm2-135m")
    assert tokenizer is not None
    compiler = GrammarCompiler(tokenizer, config.vocab_size)
    eos = tokenizer.eos_token_id or 0
    rng = torch.Generator().manual_seed(0)
    bitmask = torch.zeros(1, bitmask_words(config.vocab_size), dtype=torch.int32)
    for name, spec in WALKS.items():
        matcher = compiler.matcher(spec)
        fills: list[float] = []
        while len(fills) < steps and matcher.failure is None and not matcher.is_terminated:
            start = time.perf_counter()
            matcher.fill_bitmask(bitmask, 0, set())
            fills.append(time.perf_counter() - start)
            bits = ((bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
            allowed = [t for t in bits.nonzero().flatten().tolist() if t != eos and t < config.vocab_size]
            if matcher.failure is None and allowed:
                matcher.accept(allowed[int(torch.randint(len(allowed), (1,), generator=rng))])
        print(f"{name}: {len(fills)} masks, median {ms(statistics.median(fills))}, max {ms(max(fills))}; "
              f"{matcher.failure or 'no limit reached'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="compilations to time (default: 20)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved A/B rounds (default: 5)")
    parser.add_argument("--batch", type=int, default=8, help="requests per batch (default: 8)")
    parser.add_argument("--walk", type=int, default=150, help="tokens per random walk (default: 150)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request (default: 32)")
    args = parser.parse_args()
    grammar_costs(args.repeats)
    random_walks(args.walk)
    batch_cost(args.rounds, args.batch, args.tokens)


if __name__ == "__main__":
    main()
