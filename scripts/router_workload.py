"""Send a shared-prefix chat workload through a router and report the workers' prefix-cache miss tokens.

    python scripts/router_workload.py --router http://127.0.0.1:3001 --workers http://127.0.0.1:8100 \
        http://127.0.0.1:8101 --label kv_aware [--prefixes 8 --per-prefix 10 --concurrency 2 --max-tokens 4 --stream]

Each of --prefixes long system prompts (distinct per --label, so one run's prefixes never hit another's
cache) is sent --per-prefix times with a different short question, the requests in a shuffled order (a fixed
seed; a strict rotation over an even number of prefixes would let round robin keep each prefix on one worker).
Miss tokens are the workers' prompt tokens minus their prefix-cache hit tokens (vllm:prefix_cache_queries and
vllm:prefix_cache_hits, before and after). The ideal is what one cache holding everything would miss: each
request's tokens past the longest full-block prefix it shares with any earlier request (token ids from a
worker's /v1/chat/completions/render), so each distinct prefix is computed once. Standard library only,
so any Python 3.10+ runs it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

WORDS = ("river stone lantern orbit velvet copper meadow signal harbor cinder quartz willow ember falcon "
         "glacier tundra prism saffron beacon canyon marble thistle juniper cobalt mosaic delta fjord "
         "granite nimbus pollen raven summit tidal vector zephyr amber basalt").split()
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")


def _post(url: str, body: dict, timeout: float = 300.0) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _stream(url: str, body: dict, timeout: float = 300.0) -> None:
    """POST a streamed request and read its server-sent events to the end."""
    request = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for line in response:
            if line.strip() == b"data: [DONE]":
                return


def _counters(worker: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{worker}/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {}
    for name in COUNTERS:
        # a counter is exposed as NAME_total (prometheus_client) or NAME; labels, if any, are summed over
        pattern = rf"^{re.escape(name)}(?:_total)?(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$"
        values[name] = sum(float(m) for m in re.findall(pattern, text, re.M))
    return values


def _messages(label: str, prefixes: int, per_prefix: int, words: int) -> list[tuple[int, list[dict]]]:
    rng = random.Random(label)
    systems = [f"You are assistant {label}-{p}. " + " ".join(rng.choice(WORDS) for _ in range(words))
               for p in range(prefixes)]
    requests = [(p, [{"role": "system", "content": systems[p]},
                     {"role": "user", "content": f"Question {q}: name one word from the list above."}])
                for q in range(per_prefix) for p in range(prefixes)]
    random.Random(0).shuffle(requests)  # the same order for every label, so policies compare on one sequence
    return requests


def _ideal_misses(worker: str, model: str, requests: list[tuple[int, list[dict]]], block: int) -> tuple[int, int]:
    """(prompt tokens, ideal miss tokens) of the workload on one cache that keeps every block."""
    seen: list[list[int]] = []
    total = misses = 0
    for _, messages in requests:
        ids = _post(f"{worker}/v1/chat/completions/render", {"model": model, "messages": messages})["token_ids"]
        shared = max((_common(ids, earlier) for earlier in seen), default=0)  # prompts share their first blocks too
        cached = min(shared, len(ids) - 1) // block * block  # full blocks only; the last token is always computed
        total += len(ids)
        misses += len(ids) - cached
        seen.append(ids)
    return total, misses


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router", required=True)
    parser.add_argument("--workers", nargs="+", required=True)
    parser.add_argument("--label", required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--per-prefix", type=int, default=10)
    parser.add_argument("--words", type=int, default=300, help="words in each system prompt")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens each answer generates")
    parser.add_argument("--stream", action="store_true",
                        help="stream the answers, as chat clients do (a router then sees when a prefill ends)")
    args = parser.parse_args()
    requests = _messages(args.label, args.prefixes, args.per_prefix, args.words)
    before = [_counters(w) for w in args.workers]

    def send(item: tuple[int, list[dict]]) -> None:
        body = {"model": args.model, "messages": item[1], "max_tokens": args.max_tokens, "temperature": 0.0}
        if args.stream:
            _stream(f"{args.router}/v1/chat/completions", body)
        else:
            _post(f"{args.router}/v1/chat/completions", body)

    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(send, requests))
    after = [_counters(w) for w in args.workers]
    per_worker = [int(a[COUNTERS[0]] - b[COUNTERS[0]] - (a[COUNTERS[1]] - b[COUNTERS[1]]))
                  for a, b in zip(after, before)]
    queries = [int(a[COUNTERS[0]] - b[COUNTERS[0]]) for a, b in zip(after, before)]
    total, ideal = _ideal_misses(args.workers[0], args.model, requests, args.block_size)
    result = {"label": args.label, "stream": args.stream, "max_tokens": args.max_tokens, "requests": len(requests),
              "prompt_tokens": total, "prompt_tokens_per_worker": queries, "miss_tokens_per_worker": per_worker,
              "miss_tokens": sum(per_worker), "ideal_miss_tokens": ideal,
              "ratio_to_ideal": round(sum(per_worker) / ideal, 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
