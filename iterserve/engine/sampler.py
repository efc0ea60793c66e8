"""Turn one step's logits into next tokens, row by row with each request's own parameters.

Order of operations follows vLLM: logit_bias, penalties, ``allowed_token_ids``, ``bad_words`` and
``min_tokens`` act on the raw logits, a row with a grammar keeps only the tokens its grammar allows,
then greedy rows take the argmax, the rest are scaled by temperature, truncated by top-k, top-p and
min-p, and sampled. A request with a seed draws from its own generator, so its output does not depend on
which other requests share the batch. Logprobs are those of the raw logits (vLLM's default), each with
its rank in the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from iterserve.engine.spec_decode.rejection_sampler import accept_drafts
from iterserve.outputs import TokenLogprobs
from iterserve.platforms.ops import ops_of
from iterserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids: frozenset[int]  # EOS and stop_token_ids, masked while fewer than min_tokens are out
    generator: torch.Generator | None = None
    allowed_tokens: torch.Tensor | None = None  # packed int32 bitmask of the tokens a grammar allows next


@dataclass
class Verdict:
    """What verification made of one sequence's drafts: those accepted (they precede its sampled token)."""

    accepted: list[int]
    logprobs: list[TokenLogprobs | None]  # one per accepted draft, as for a sampled token


@dataclass
class SampleResult:
    """One sampled token per sampling sequence; a sequence that verified drafts gets its accepted ones first."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # sampled token's logprob plus the top-N alternatives
    # scheduled index -> (index of the first prompt token covered, its logprobs and those after it)
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    verdicts: dict[int, Verdict] = field(default_factory=dict)  # sampling index -> its drafts' verdict


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprobs]:
    """For each row of log-probabilities: the chosen token's (logprob, rank) plus the ``num_top`` most likely."""
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    chosen_values = chosen.squeeze(1).tolist()
    top = torch.topk(logprobs, num_top, dim=1) if num_top else None
    entries = []
    for i, token in enumerate(tokens):
        entry = {token: (chosen_values[i], ranks[i])}
        if top is not None:
            for rank, (v, t) in enumerate(zip(top.values[i].tolist(), top.indices[i].tolist()), start=1):
                entry.setdefault(t, (v, rank))
        entries.append(entry)
    return entries


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """OpenAI's logit_bias: add each request's biases to its raw logits, in place."""
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            ids = torch.tensor(list(row.params.logit_bias), dtype=torch.long, device=logits.device)
            bias = torch.tensor(list(row.params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            logits[i, ids] += bias


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition (prompt + output), presence and frequency (output only) penalties, in place."""
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
        out = out[out < vocab]
        counts = torch.bincount(out, minlength=vocab).to(logits.dtype)
        if p.repetition_penalty != 1:
            seen = counts > 0
            prompt = torch.tensor(row.prompt_token_ids, dtype=torch.long, device=logits.device)
            seen[prompt[prompt < vocab]] = True
            x = logits[i]
            penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            logits[i] = torch.where(seen, penalised, x)
        if p.frequency_penalty:
            logits[i] -= p.frequency_penalty * counts
        if p.presence_penalty:
            logits[i] -= p.presence_penalty * (counts > 0).to(logits.dtype)


def apply_token_limits(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """vLLM's ``allowed_token_ids`` (every other token is masked) and ``bad_words`` (the token that would
    complete a bad word after the output's last tokens is masked), in place."""
    for i, row in enumerate(rows):
        p = row.params
        if p.allowed_token_ids is not None:
            keep = torch.full_like(logits[i], float("-inf"))
            ids = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=logits.device)
            keep[ids] = 0.0
            logits[i] += keep
        banned = [word[-1] for word in p.bad_words_token_ids or ()
                  if len(word) == 1 or row.output_token_ids[-(len(word) - 1):] == word[:-1]]
        if banned:
            logits[i, [t for t in banned if t < logits.shape[-1]]] = float("-inf")


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a packed token bitmask (bit ``t % 32`` of word ``t // 32`` is token t)."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of ``rows`` whose token's bit is 0 in ``bitmask``.

    ``bitmask`` has one packed int32 row per entry of ``rows``: bit ``t % 32`` of word ``t // 32``
    allows token t. Other rows are not touched, so unconstrained requests sample as they would alone.
    """
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool().to(logits.device)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _truncate(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on one row; returns probabilities."""
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(-1)
        drop_sorted = cum - sorted_probs >= p.top_p  # keep the smallest prefix reaching top_p
        probs = probs.masked_fill(drop_sorted.scatter(0, order, drop_sorted), 0.0)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from ``probs`` by inverting its CDF with a single uniform number.

    ``torch.multinomial`` spends most of a millisecond on a 49k vocabulary filling random
    numbers; one uniform and a binary search over the cumulative sum cost a few percent of that.
    """
    cdf = probs.cumsum(-1)
    u = torch.rand(1, generator=generator, device=probs.device) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True).item())
    if index >= probs.shape[-1]:  # u rounded up to the total: take the last token with mass
        index = int(probs.nonzero()[-1].item())
    return index


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of float32 rows: on the CPU by the C++ kernel where it is built, a quarter
    of torch's time (``csrc/layer_ops.cpp``, ``argmax_rows``)."""
    return ops_of(logits).argmax_rows(logits)


class Sampler:
    """Samples one token per sequence; ``generator`` serves requests that have no seed of their own."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 drafts: list[list[int]] | None = None) -> SampleResult:
        """One token per sequence. Without ``drafts`` each row is a sequence; with them, sequence i
        owns ``len(drafts[i]) + 1`` consecutive rows, row j holding its logits after its draft j - 1
        (and ``rows[j]`` its output with those drafts appended), and its drafts are verified."""
        logits = logits.float()
        want_logprobs = any(r.params.needs_logprobs for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        self._process(logits, rows)
        greedy = argmax_rows(logits).tolist()

        def draw(r: int) -> int:
            row = rows[r]
            return greedy[r] if row.params.greedy else _draw(_truncate(logits[r], row.params),
                                                             row.generator or self.generator)

        def logprobs_of(r: int, token: int) -> TokenLogprobs | None:
            if raw_logprobs is None or not rows[r].params.needs_logprobs:
                return None
            return token_logprobs(raw_logprobs[r:r + 1], [token], rows[r].params.logprobs or 0)[0]

        def draw_from(first: int) -> Callable[[int], int]:
            return lambda j: draw(first + j)

        result = SampleResult([], [])
        first = 0
        for i, proposed in enumerate(drafts if drafts is not None else [[]] * len(rows)):
            accepted, token = accept_drafts(draw_from(first), proposed)
            result.token_ids.append(token)
            result.logprobs.append(logprobs_of(first + len(accepted), token))
            if proposed:
                result.verdicts[i] = Verdict(accepted, [logprobs_of(first + j, t) for j, t in enumerate(accepted)])
            first += len(proposed) + 1
        return result

    @staticmethod
    def _process(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Everything that acts on the logits before the draw, in place: logit_bias, penalties, the
        stop tokens ``min_tokens`` holds back, and the grammars' masks."""
        apply_logit_bias(logits, rows)
        apply_penalties(logits, rows)
        apply_token_limits(logits, rows)
        for i, row in enumerate(rows):
            if len(row.output_token_ids) < row.params.min_tokens and row.stop_ids:
                ids = [t for t in row.stop_ids if t < logits.shape[-1]]
                logits[i, ids] = float("-inf")
        masks = [(i, row.allowed_tokens) for i, row in enumerate(rows) if row.allowed_tokens is not None]
        if masks:
            apply_token_bitmask(logits, [i for i, _ in masks], torch.stack([m for _, m in masks]))
