"""What a hostile request costs everyone else, measured on a server this script starts (not part of the
test suite; figures in docs/compatibility.md, "Hostile input"):

1. a plain 20-token chat's latency alone and beside an ambiguous grammar that gets slower every step
   (n=8, 200 tokens, sent again as soon as it ends), alone and beside interleaved over ROUNDS rounds;
   the bar is beside / alone <= 3 (medians);
2. /health's longest silence (the longest time between two of its answers, polled back to back) while a
   maximal logprobs chat runs: n=128, top_logprobs=20 and the most tokens --max-response-logprobs allows;
   the bar is <= 1 s. The API process's resident memory before and after is printed too.

    PYTHONPATH=. .venv/bin/python scripts/measure_hostile.py [--rounds 5] [--port 8420] [--parts grammar,health]
        [--server-log FILE] [-- SERVE FLAGS...]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from iterserve.config import ServerConfig

ROOT = Path(__file__).resolve().parent.parent
AMBIGUOUS = 'root ::= x\nx ::= x x | "a" | "b" | x "a" | "a" x\n'  # issue 49: each step slower than the last
MAX_N = 128
TOP_LOGPROBS = 20


def start_server(port: int, flags: list[str], log: Path | None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "iterserve.cli.main", "serve", "--port", str(port), *flags]
    out = log.open("wb") if log is not None else subprocess.DEVNULL
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.terminate()
    raise RuntimeError("the server was not ready after 600 s")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def plain_chat(c: httpx.Client) -> float:
    start = time.perf_counter()
    r = c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Name three rivers of Europe."}], "max_tokens": 20,
        "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return time.perf_counter() - start


class HostileLoop:
    """The ambiguous-grammar request, sent again as soon as it ends, from a thread; counts how each ended."""

    def __init__(self, c: httpx.Client) -> None:
        self.c = c
        self.endings: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            r = self.c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Write a's and b's."}], "n": 8, "max_tokens": 200,
                "structured_outputs": {"grammar": AMBIGUOUS}})
            if r.status_code != 200:
                ending = f"{r.status_code}: {r.json()['error']['message'][:90]}"
            else:
                ending = "finish_reason " + ",".join(sorted({str(ch["finish_reason"]) for ch in r.json()["choices"]}))
            self.endings[ending] = self.endings.get(ending, 0) + 1

    def __enter__(self) -> HostileLoop:
        self.thread.start()
        time.sleep(2.0)  # the hostile request is admitted and decoding
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(600)


def grammar_beside(url: str, rounds: int) -> None:
    with httpx.Client(base_url=url, timeout=600) as c, httpx.Client(base_url=url, timeout=600) as hostile_client:
        plain_chat(c)  # warm-up: first-request costs land on neither side
        alone, beside = [], []
        endings: dict[str, int] = {}
        for _ in range(rounds):
            alone.append(plain_chat(c))
            with HostileLoop(hostile_client) as loop:
                beside.append(plain_chat(c))
            for k, v in loop.endings.items():
                endings[k] = endings.get(k, 0) + v
            alone.append(plain_chat(c))
    a, b = statistics.median(alone), statistics.median(beside)
    print(f"plain 20-token chat alone:  median {a:.2f} s  {[round(x, 2) for x in alone]}")
    print(f"beside the hostile grammar: median {b:.2f} s  {[round(x, 2) for x in beside]}")
    print(f"ratio {b / a:.2f} (bar: <= 3); the hostile requests ended:")
    for ending, count in sorted(endings.items()):
        print(f"  {count} x {ending}")


def health_silence(url: str, server_pid: int, max_response_logprobs: int) -> None:
    max_tokens = max_response_logprobs // (MAX_N * (TOP_LOGPROBS + 1))
    answers: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            while not done.is_set():
                if c.get("/health").status_code == 200:
                    answers.append(time.perf_counter())

    before = rss_mib(server_pid)
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    time.sleep(0.5)
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", timeout=1800, json={
        "messages": [{"role": "user", "content": "Tell me a story."}], "n": MAX_N, "logprobs": True,
        "top_logprobs": TOP_LOGPROBS, "max_tokens": max_tokens, "ignore_eos": True})
    took = time.perf_counter() - start
    time.sleep(0.5)
    done.set()
    thread.join(60)
    r.raise_for_status()
    window = [t for t in answers if start - 0.5 <= t]
    gaps = [b - a for a, b in zip(window, window[1:])]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    ended = window[worst + 1] - (start + took)  # where the longest silence ended, against the response's arrival
    entries = MAX_N * max_tokens * (TOP_LOGPROBS + 1)
    print(f"maximal logprobs chat: n={MAX_N}, top_logprobs={TOP_LOGPROBS}, max_tokens={max_tokens} "
          f"({entries} entries), {len(r.content) / 2**20:.0f} MiB body, {took:.1f} s")
    began = took + ended - gaps[worst]
    print(f"/health: {len(gaps) + 1} answers, longest silence {gaps[worst]:.3f} s (bar: <= 1 s), ending "
          f"{ended:+.2f} s from the response's arrival (it began {began:.1f} s after the request was sent)")
    print(f"API process RSS: {before:.0f} MiB before, {rss_mib(server_pid):.0f} MiB after")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--port", type=int, default=8420)
    p.add_argument("--parts", default="grammar,health", help="which measurements to run (comma-separated)")
    p.add_argument("--server-log", type=Path, help="write the server's output here (it is dropped otherwise)")
    p.add_argument("serve_flags", nargs="*", help="flags for iterserve serve (after --)")
    args = p.parse_args()
    server = start_server(args.port, args.serve_flags, args.server_log)
    url = f"http://127.0.0.1:{args.port}"
    try:
        if "grammar" in args.parts:
            grammar_beside(url, args.rounds)
        limit = ServerConfig.max_response_logprobs
        for i, flag in enumerate(args.serve_flags):
            if flag == "--max-response-logprobs":
                limit = int(args.serve_flags[i + 1])
        if "health" in args.parts:
            health_silence(url, server.pid, limit)
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
