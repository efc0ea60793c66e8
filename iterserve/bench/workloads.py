"""Benchmark workloads: seeded synthetic requests and loaders for users' own datasets.

A workload is a list of :class:`Request`: a prompt (token ids, text or chat messages), its length
in tokens and how many tokens to generate for it. Synthetic workloads draw prompt and output
lengths from a :class:`LengthDist` and fill prompts with random token ids or with sentences from
a small built-in corpus; the same seed always gives the same workload.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from typing_extensions import TypeIs

from iterserve.tokenizer import Tokenizer

Messages = list[dict[str, str]]
Prompt = str | list[int] | Messages

# Token ids below this are where vocabularies keep special and control tokens; random prompts avoid them.
FIRST_RANDOM_TOKEN_ID = 100


@dataclass
class Request:
    prompt: Prompt
    prompt_len: int
    output_len: int


# -- length distributions -------------------------------------------------------------------------

_DIST_PARAMS = {
    "fixed": ("n",),
    "uniform": ("low", "high"),
    "normal": ("mean", "std", "max"),
    "lognormal": ("median", "sigma", "max"),
    "pareto": ("min", "alpha", "max"),
}


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts, written ``kind:p1:p2...``.

    ``fixed:N``; ``uniform:LOW:HIGH`` (inclusive); ``normal:MEAN:STD:MAX``;
    ``lognormal:MEDIAN:SIGMA:MAX``; ``pareto:MIN:ALPHA:MAX``. Every draw is rounded and clipped
    to ``[low, high]`` (``[1, MAX]`` for normal and lognormal, ``[MIN, MAX]`` for pareto), so heavy
    tails stay within what a model's context can hold.
    """

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        if spec.strip().isdigit():  # vLLM's bench serve takes a plain length
            spec = f"fixed:{spec.strip()}"
        kind, *fields = spec.strip().split(":")
        if kind not in _DIST_PARAMS:
            raise ValueError(f"unknown length distribution {spec!r}; use one of {', '.join(_DIST_PARAMS)}")
        names = _DIST_PARAMS[kind]
        usage = f"{kind}:" + ":".join(n.upper() for n in names)
        if len(fields) != len(names):
            raise ValueError(f"length distribution {spec!r} needs the form {usage}")
        try:
            params = tuple(float(f) for f in fields)
        except ValueError:
            raise ValueError(f"length distribution {spec!r} has a non-numeric field; use {usage}") from None
        dist = cls(kind, params)
        if not all(math.isfinite(p) and p > 0 for p in params) or dist.low > dist.high:
            raise ValueError(f"length distribution {spec!r} needs positive parameters and LOW <= HIGH ({usage})")
        return dist

    def __str__(self) -> str:
        return ":".join([self.kind, *(f"{p:g}" for p in self.params)])

    @property
    def low(self) -> int:
        return int(self.params[0]) if self.kind in ("fixed", "uniform", "pareto") else 1

    @property
    def high(self) -> int:
        return int(self.params[0] if self.kind == "fixed" else self.params[-1])

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        """``n`` draws, rounded and clipped to ``[low, high]``."""
        a, b = self.params[0], self.params[1] if len(self.params) > 1 else 0.0
        if self.kind == "fixed":
            x = np.full(n, a)
        elif self.kind == "uniform":
            x = rng.integers(int(a), int(b) + 1, size=n)
        elif self.kind == "normal":
            x = rng.normal(a, b, size=n)
        elif self.kind == "lognormal":
            x = rng.lognormal(math.log(a), b, size=n)
        else:  # pareto: Lomax draws shifted and scaled to start at MIN
            x = a * (1.0 + rng.pareto(b, size=n))
        return np.clip(np.rint(x), self.low, self.high).astype(int).tolist()


# -- prompt sources -------------------------------------------------------------------------------

CORPUS = """\
It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a
wife. However little known the feelings or views of such a man may be on his first entering a neighbourhood, this
truth is so well fixed in the minds of the surrounding families, that he is considered the rightful property of
some one or other of their daughters.

Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, and nothing
particular to interest me on shore, I thought I would sail about a little and see the watery part of the world. It
is a way I have of driving off the spleen and regulating the circulation. Whenever I find myself growing grim
about the mouth, whenever it is a damp, drizzly November in my soul, then I account it high time to get to sea as
soon as I can.

It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, it
was the epoch of belief, it was the epoch of incredulity. There were a king with a large jaw and a queen with a
plain face, on the throne of England. In both countries it was clearer than crystal to the lords of the State
preserves of loaves and fishes, that things in general were settled for ever.

Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do. Once or
twice she had peeped into the book her sister was reading, but it had no pictures or conversations in it. So she
was considering in her own mind whether the pleasure of making a daisy-chain would be worth the trouble of getting
up and picking the daisies, when suddenly a White Rabbit with pink eyes ran close by her.

The sea was calm that night, and the moon shone brightly over the water. Far off, a lighthouse blinked at regular
intervals, and the fishermen on the quay counted its flashes as they mended their nets. Nobody spoke of the storm
that had passed the week before, though every boat in the harbour still bore its marks.

Four score and seven years ago our fathers brought forth on this continent a new nation, conceived in liberty, and
dedicated to the proposition that all men are created equal. Now we are engaged in a great civil war, testing
whether that nation, or any nation so conceived and so dedicated, can long endure. We are met on a great
battle-field of that war.
"""

SENTENCES = [s for s in re.split(r"(?<=[.!?])\s+", " ".join(CORPUS.split())) if s]


def random_tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    """``n`` token ids drawn uniformly from ``[FIRST_RANDOM_TOKEN_ID, vocab_size)``."""
    if vocab_size <= FIRST_RANDOM_TOKEN_ID:
        raise ValueError(f"vocabulary of {vocab_size} tokens is too small for random prompts")
    return rng.integers(FIRST_RANDOM_TOKEN_ID, vocab_size, size=n).tolist()


def text_tokens(rng: np.random.Generator, n: int, tokenizer: Tokenizer) -> list[int]:
    """The first ``n`` tokens of randomly chosen corpus sentences, so prompts read as real text."""
    ids: list[int] = []
    while len(ids) < n:
        chunk = " ".join(SENTENCES[i] for i in rng.integers(0, len(SENTENCES), size=8))
        ids += tokenizer.encode(" " + chunk if ids else chunk, add_special_tokens=False)
    return ids[:n]


@dataclass
class WorkloadSpec:
    """Everything that determines a workload; stored with results so a run can be repeated."""

    dataset: str = "random"  # random | text | copy | jsonl | sharegpt
    num_prompts: int = 64
    input_len: str = "uniform:32:256"
    output_len: str = "lognormal:64:1:384"
    shared_prefix_len: int = 0  # tokens of one system prompt in front of every synthetic prompt
    dataset_path: str | None = None
    dataset_output_len: int = 128  # for JSONL records that state no output length
    seed: int = 0


DATASETS = ("random", "text", "copy", "jsonl", "sharegpt")

COPY_INSTRUCTION = "Repeat the following text exactly, word for word:\n\n"


def copy_workload(spec: WorkloadSpec, tokenizer: Tokenizer) -> list[Request]:
    """Chat requests asking to repeat a passage of corpus text (input_len tokens), each asking for as
    many tokens as the passage has: the copy-heavy work n-gram speculation drafts well for."""
    rng = np.random.default_rng(spec.seed)
    requests = []
    for n_in in LengthDist.parse(spec.input_len).sample(rng, spec.num_prompts):
        passage = tokenizer.decode(text_tokens(rng, n_in, tokenizer))
        messages = [{"role": "user", "content": COPY_INSTRUCTION + passage}]
        prompt_len = len(tokenizer.apply_chat_template(messages, tokenize=True))
        requests.append(Request(messages, prompt_len, len(tokenizer.encode(passage, add_special_tokens=False))))
    return requests


def synthetic_workload(
    spec: WorkloadSpec, *, vocab_size: int | None = None, tokenizer: Tokenizer | None = None
) -> list[Request]:
    """Seeded requests with random-token (``random``) or corpus-text (``text``) prompts.

    Random prompts are token ids; text prompts are strings decoded from the trimmed tokens, with
    ``prompt_len`` their re-encoded length. With ``shared_prefix_len`` every prompt starts with
    the same prefix of that many tokens, as requests behind one long system prompt do.
    """
    if spec.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {spec.num_prompts}")
    if spec.shared_prefix_len < 0:
        raise ValueError(f"shared prefix length must be >= 0, got {spec.shared_prefix_len}")
    rng = np.random.default_rng(spec.seed)
    input_lens = LengthDist.parse(spec.input_len).sample(rng, spec.num_prompts)
    output_lens = LengthDist.parse(spec.output_len).sample(rng, spec.num_prompts)
    if spec.dataset == "text":
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; use --dataset random for a model without one")
        tok = tokenizer

        def draw(n: int) -> list[int]:
            return text_tokens(rng, n, tok)

        def request(ids: list[int], output_len: int) -> Request:
            text = tok.decode(ids)
            return Request(text, len(tok.encode(text, add_special_tokens=False)), output_len)
    elif spec.dataset == "random":
        vocab = vocab_size or (tokenizer.vocab_size if tokenizer is not None else None)
        if vocab is None:
            raise ValueError("random prompts need a vocabulary size or a tokenizer")

        def draw(n: int) -> list[int]:
            return random_tokens(rng, n, vocab)

        def request(ids: list[int], output_len: int) -> Request:
            return Request(ids, len(ids), output_len)
    else:
        raise ValueError(f"{spec.dataset!r} is not a synthetic dataset; use random or text")
    prefix = draw(spec.shared_prefix_len) if spec.shared_prefix_len else []
    return [request(prefix + draw(n_in), n_out) for n_in, n_out in zip(input_lens, output_lens)]


# -- datasets -------------------------------------------------------------------------------------


def is_token_ids(prompt: Prompt) -> TypeIs[list[int]]:
    """Whether a workload prompt is token ids (else text or chat messages)."""
    return isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)


def _prompt_len(prompt: Prompt, tokenizer: Tokenizer | None, where: str) -> int:
    if is_token_ids(prompt):
        return len(prompt)
    if tokenizer is None:
        raise ValueError(f"{where}: text prompts need a tokenizer to count their tokens")
    if isinstance(prompt, str):
        return len(tokenizer.encode(prompt, add_special_tokens=False))
    return len(tokenizer.apply_chat_template(prompt, tokenize=True))


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value)
    )


def load_jsonl(path: str | Path, tokenizer: Tokenizer | None, default_output_len: int = 128) -> list[Request]:
    """One request per line: ``{"prompt": text or token ids}`` or ``{"messages": [{"role", "content"}...]}``,
    with an optional ``output_len`` (or ``max_tokens``); blank lines are skipped."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            if "prompt" in record:
                prompt = record["prompt"]
                ok = (isinstance(prompt, str) and prompt) or (
                    isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)
                )
                if not ok:
                    raise ValueError(f"{where}: 'prompt' must be a non-empty string or a list of token ids")
            elif "messages" in record:
                prompt = record["messages"]
                if not _is_messages(prompt):
                    raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
            else:
                raise ValueError(f"{where}: a record needs 'prompt' or 'messages'")
            out = record.get("output_len", record.get("max_tokens", default_output_len))
            if isinstance(out, bool) or not isinstance(out, int) or out < 1:
                raise ValueError(f"{where}: output_len/max_tokens must be a positive integer, got {out!r}")
            requests.append(Request(prompt, _prompt_len(prompt, tokenizer, where), out))
    if not requests:
        raise ValueError(f"{path}: no requests in file")
    return requests


def load_sharegpt(path: str | Path, tokenizer: Tokenizer) -> list[Request]:
    """A ShareGPT-style JSON list of ``{"conversations": [{"from": "human"|"gpt", "value": ...}]}``.

    The first human turn is the prompt and the gpt turn after it sets the output length (its
    token count). Conversations without such a pair are skipped, as real dumps hold many.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations, got {type(data).__name__}")
    requests = []
    for index, entry in enumerate(data):
        where = f"{path}: entry {index}"
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise ValueError(f"{where}: expected an object with a 'conversations' list")
        for k, turn in enumerate(turns):
            if not (isinstance(turn, dict) and all(isinstance(turn.get(k), str) for k in ("from", "value"))):
                raise ValueError(f"{where}, turn {k}: expected {{\"from\": str, \"value\": str}}")
        pair = next(
            ((a["value"], b["value"]) for a, b in zip(turns, turns[1:]) if a["from"] == "human" and b["from"] == "gpt"),
            None,
        )
        if pair is None or not pair[0]:
            continue
        output_len = len(tokenizer.encode(pair[1], add_special_tokens=False))
        if output_len:
            requests.append(Request(pair[0], len(tokenizer.encode(pair[0], add_special_tokens=False)), output_len))
    if not requests:
        raise ValueError(f"{path}: no conversation has a human turn followed by a gpt turn")
    return requests


def sample_requests(requests: list[Request], n: int | None, seed: int) -> list[Request]:
    """A seeded choice of ``n`` requests (repeating some when the dataset has fewer); all if None."""
    if n is None:
        return requests
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(requests), size=n, replace=n > len(requests))
    return [requests[i] for i in picks]


def make_workload(
    spec: WorkloadSpec, *, tokenizer: Tokenizer | None, vocab_size: int | None = None
) -> list[Request]:
    """The requests a spec describes: synthetic, or drawn from the dataset file it names."""
    if spec.dataset in ("random", "text"):
        return synthetic_workload(spec, vocab_size=vocab_size, tokenizer=tokenizer)
    if spec.dataset == "copy":
        if tokenizer is None:
            raise ValueError("copy prompts are text: they need a model with a tokenizer")
        return copy_workload(spec, tokenizer)
    if spec.dataset not in DATASETS:
        raise ValueError(f"unknown dataset {spec.dataset!r}; use one of {', '.join(DATASETS)}")
    if spec.dataset_path is None:
        raise ValueError(f"--dataset {spec.dataset} needs --dataset-path")
    if spec.dataset == "jsonl":
        loaded = load_jsonl(spec.dataset_path, tokenizer, spec.dataset_output_len)
    else:
        if tokenizer is None:
            raise ValueError("ShareGPT datasets need a tokenizer to count prompt and reply tokens")
        loaded = load_sharegpt(spec.dataset_path, tokenizer)
    return sample_requests(loaded, spec.num_prompts, spec.seed)


