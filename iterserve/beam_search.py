"""Beam search on top of the engine, as vLLM runs it (``LLM.beam_search``).

Each step asks the engine for one token, with the top ``2 * beam_width`` logprobs, for every live beam
of every prompt at once; the candidates are ranked by cumulative logprob (over length ** length_penalty)
and the best ``beam_width`` live on. A beam is a new prompt each step, so the prefix cache is what makes
it cheap: every beam's tokens but the last are cached from the step before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from iterserve.outputs import Logprob, RequestOutput
from iterserve.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` are the prompt's and the generated ones (as in vLLM), ``logprobs`` one entry per
    generated token, ``text`` the decoded tokens (set on the returned beams)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Instance:
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None,
                      length_penalty: float = 1.0) -> float:
    """vLLM's score: cumulative logprob over length ** length_penalty, a final EOS not counted in the length."""
    length = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (length ** length_penalty)


def run_beam_search(
    generate: Callable[[list[list[int]], SamplingParams], list[RequestOutput]],
    prompts: list[list[int]],
    params: BeamSearchParams,
    eos_token_id: int | None,
    decode: Callable[[list[int]], str],
    max_model_len: int,
    use_tqdm: bool = False,
) -> list[BeamSearchOutput]:
    """Beam search from each tokenized prompt; ``generate`` runs one batch of prompts through the engine.

    A beam ends on EOS (unless ``ignore_eos``), after ``max_tokens`` tokens, or when it fills the context."""
    width = params.beam_width

    def score(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, params.length_penalty)

    instances = [_Instance([BeamSearchSequence(list(p))]) for p in prompts]
    step_params = SamplingParams(logprobs=2 * width, max_tokens=1, temperature=params.temperature)
    for step in tqdm(range(params.max_tokens), desc="Beam search", unit="token", disable=not use_tqdm):
        live = [(instance, beam) for instance in instances for beam in instance.beams]
        if not live:
            break
        outputs = generate([beam.tokens for _, beam in live], step_params)
        candidates: dict[int, list[BeamSearchSequence]] = {id(instance): [] for instance in instances}
        for (instance, beam), output in zip(live, outputs):
            entry = (output.outputs[0].logprobs or [{}])[0]
            for token, logprob in entry.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry],
                                         beam.cum_logprob + logprob.logprob)
                if token == eos_token_id and not params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", token
                    instance.completed.append(new)
                    continue
                if len(new.tokens) >= max_model_len or step == params.max_tokens - 1:
                    new.finish_reason = "length"
                candidates[id(instance)].append(new)
        for instance in instances:
            instance.beams = sorted(candidates[id(instance)], key=score, reverse=True)[:width]
            # a beam that filled the context cannot be extended: it is done
            instance.completed.extend(b for b in instance.beams if len(b.tokens) >= max_model_len)
            instance.beams = [b for b in instance.beams if len(b.tokens) < max_model_len]
    results = []
    for instance in instances:
        best = sorted(instance.completed + instance.beams, key=score, reverse=True)[:width]
        for beam in best:
            beam.text = decode(beam.tokens)
        results.append(BeamSearchOutput(best))
    return results
