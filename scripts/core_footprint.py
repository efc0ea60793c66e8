"""The engine core's memory across rounds of many streams that disconnect mid-answer: its resident set after
each round, once the core is idle again. A footprint that keeps growing round after round is a leak; one
that levels off is the allocator's working set.

    .venv/bin/python scripts/core_footprint.py --rounds 3 --streams 200
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def rss_mb(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024


async def stream_then_leave(client: httpx.AsyncClient, url: str, chunks: int, i: int) -> None:
    body = {"model": "smollm2-135m", "stream": True, "max_tokens": 200, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Story number {i}: tell me about a lighthouse."}]}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        seen = 0
        async for _ in r.aiter_lines():
            seen += 1
            if seen >= chunks:
                return  # leaving the block closes the connection: the server aborts the request


async def one_round(url: str, streams: int, chunks: int) -> None:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams)) as client:
        await asyncio.gather(*(stream_then_leave(client, url, chunks, i) for i in range(streams)))


def wait_idle(url: str) -> None:
    """Until the server runs and queues no request (its /metrics), so the core has gone idle."""
    for _ in range(600):
        text = httpx.get(f"{url}/metrics").text
        busy = sum(float(v) for v in re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)", text, re.M))
        if busy == 0:
            time.sleep(1.0)  # the core's idle branch runs after its last step's outputs
            return
        time.sleep(0.5)
    raise RuntimeError("the server never went idle")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--chunks", type=int, default=8, help="stream chunks read before disconnecting")
    ap.add_argument("--port", type=int, default=8231)
    ap.add_argument("serve_args", nargs="*", help="more `iterserve serve` flags, after --")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "iterserve.cli.main", "serve", "--port", str(args.port),
                               "--max-num-seqs", "256", *args.serve_args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(1200):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        core = children(server.pid)[-1]
        print(f"core process {core}: {rss_mb(core):,.0f} MB ready")
        for n in range(1, args.rounds + 1):
            asyncio.run(one_round(url, args.streams, args.chunks))
            wait_idle(url)
            print(f"after round {n} ({args.streams} streams, each left after {args.chunks} chunks): "
                  f"{rss_mb(core):,.0f} MB; API process {rss_mb(server.pid):,.0f} MB")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
