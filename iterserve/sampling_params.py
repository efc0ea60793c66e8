"""Per-request decoding options, with vLLM's names and defaults, validated when built.

Everything the engine step relies on is checked here, before a request is queued: a value that
only fails inside a step fails every request batched with it, and offline callers get the same
protection as the HTTP server.
"""

from __future__ import annotations

import enum
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Protocol

from iterserve.config.runtime import MAX_LOGPROBS
from iterserve.config.structured_outputs import StructuredOutputsParams, grammar_checks_deferred
from iterserve.errors import SamplingParamsError

__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams", "SamplingParamsError", "StructuredOutputsParams",
           "grammar_checks_deferred"]

# Below this temperature sampling is indistinguishable from greedy, and dividing logits by it
# overflows float32; such requests are decoded greedily (as vLLM does).
GREEDY_TEMPERATURE = 1e-5
# The sampler works in float32, where a temperature or penalty near 0 or near the float limits turns
# logits into inf/nan and fails the whole batch's step: these bound what is accepted.
MAX_TEMPERATURE = 100.0
MIN_TOP_P = 1e-8

# Stop strings are matched against the generated text after every step, and the text that could
# still become a stop string is held back by a scan whose cost grows with the square of each
# string's length: these caps keep the worst case within a fraction of a step, where thousands of
# long strings would cost seconds per step (docs/benchmarks-history.md). OpenAI allows 4 strings.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # all stop strings together
# Stop token ids are masked out of the logits on every step until min_tokens is reached.
MAX_STOP_TOKEN_IDS = 1024
# logit_bias is applied to every row that has one on every step; OpenAI allows 300 entries.
MAX_LOGIT_BIAS = 300
# n and best_of sequences share one prompt and one batch; the scheduler also caps them at max_num_seqs.
MAX_N = 128
# Each bad word is matched against every constrained row's last tokens at every step.
MAX_BAD_WORDS = 128

INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1


def _as_int(name: str, value: object, max_value: int = INT64_MAX) -> int:
    """``value`` as a plain int in [-2**63, ``max_value``]; floats and bools are refused rather than
    truncated or read as 0/1, and integers past 64 bits rather than failing where the request is sent to
    the engine core (MessagePack carries 64 bits) or where torch makes a tensor of them."""
    if isinstance(value, bool):
        raise SamplingParamsError(name, f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise SamplingParamsError(name, f"{name} must be an integer, got {value!r}") from None
    if not INT64_MIN <= number <= max_value:  # a huge int is not printed: str() refuses past 4300 digits
        raise SamplingParamsError(name, f"{name} must be in [{INT64_MIN}, {max_value}], got an integer of "
                                        f"{number.bit_length()} bits")
    return number


class RequestOutputKind(enum.Enum):
    """What each output of a request carries (vLLM's names): everything so far, only what is new, or
    one output at the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


# vLLM options this engine accepts at their defaults only, with the reason any other value is refused
# (docs/compatibility.md lists them).
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "stream_interval": (None, "every step's tokens are streamed as they come"),
    "logprob_token_ids": (None, "logprobs come for the sampled token and the top alternatives only"),
    "prompt_logprob_token_ids": (None, "prompt logprobs come for the prompt token and the top alternatives only"),
    "prompt_logprob_start": (None, "prompt logprobs cover the whole prompt"),
    "flat_logprobs": (False, "logprobs are returned as vLLM's list of dicts"),
    "thinking_token_budget": (None, "no reasoning parser is implemented"),
    "repetition_detection": (None, "repetition is not detected; use stop strings or max_tokens"),
    "routed_experts_prompt_start": (0, "no mixture-of-experts model is served"),
    "trace_decode_token_ids": (None, "decoding samples its tokens"),
    "skip_reading_prefix_cache": (None, "the prefix cache is skipped exactly when prompt logprobs are asked for"),
}


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy decoding. ``max_tokens=None`` means "until the context is full".
    Invalid values raise :class:`SamplingParamsError` (a ValueError) naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each sampled token
    prompt_logprobs: int | None = None  # top alternatives to return with each prompt token (computed in prefill)
    skip_special_tokens: bool = True
    best_of: int | None = None  # generate this many, return the n with the highest cumulative logprob
    logit_bias: dict[int, float] | None = None  # added to the raw logits of these token ids
    structured_outputs: StructuredOutputsParams | None = None
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) in the output
    detokenize: bool = True  # False: token ids only, no text (and no stop strings)
    # accepted for vLLM's sake: this tokenizer library (like vLLM's fast detokenizer) decodes special tokens as
    # they are spelled, with no spaces added between them
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] = field(default_factory=list)  # never complete one of these words
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what LLMEngine's outputs carry
    extra_args: dict[str, Any] | None = None  # for plugins, as in vLLM: carried, not read
    skip_clone: bool = False  # vLLM's hint that params may be shared; they are never copied here
    # the bad words as token id sequences (set by update_from_tokenizer, where the tokenizer is)
    bad_words_token_ids: list[list[int]] | None = None
    stream_interval: int | None = None
    logprob_token_ids: list[int] | None = None
    prompt_logprob_token_ids: list[int] | None = None
    prompt_logprob_start: int | None = None
    flat_logprobs: bool = False
    thinking_token_budget: int | None = None
    repetition_detection: Any = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None
    skip_reading_prefix_cache: bool | None = None

    @staticmethod
    def from_optional(**kwargs: Any) -> SamplingParams:
        """vLLM's constructor for request fields that may be null: a None penalty, temperature, top_p or n
        takes its default."""
        defaults: dict[str, Any] = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                    "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0}
        given: dict[str, Any] = {k: defaults[k] if v is None and k in defaults else v for k, v in kwargs.items()}
        return SamplingParams(**given)

    def update_from_tokenizer(self, tokenizer: _Encoder) -> None:
        """Tokenize the bad words, each as it starts the text and as it follows a space (vLLM's rule);
        called where the request is tokenized, before it is queued."""
        if not self.bad_words or self.bad_words_token_ids is not None:
            return
        sequences: list[list[int]] = []
        for word in self.bad_words:
            for prefix in ("", " "):
                ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        self.bad_words_token_ids = sequences

    def __post_init__(self) -> None:
        if self.seed == -1:
            self.seed = None
        self._check_types()
        self._check_vllm_options()
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < GREEDY_TEMPERATURE and self.temperature >= 0:
            self.temperature = 0.0
        stop_chars = sum(map(len, self.stop))
        checks = [
            (1 <= self.n <= MAX_N, "n", f"n must be in [1, {MAX_N}], got {self.n}"),
            (self.best_of is None or self.n <= self.best_of <= MAX_N, "best_of",
             f"best_of must be in [n, {MAX_N}] (n={self.n}), got {self.best_of}"),
            (self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, "top_k", f"top_k must be -1 (disabled) or >= 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (self.temperature <= MAX_TEMPERATURE, "temperature",
             f"temperature must be <= {MAX_TEMPERATURE:g}, got {self.temperature}"),
            (MIN_TOP_P <= self.top_p, "top_p", f"top_p must be >= {MIN_TOP_P}, got {self.top_p}"),
            (0.01 <= self.repetition_penalty <= 100, "repetition_penalty",
             f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            (all(self.stop), "stop", "stop must be a list of non-empty strings"),
            (stop_chars <= MAX_STOP_CHARS, "stop",
             f"stop strings have {stop_chars} characters in all; at most {MAX_STOP_CHARS} are allowed"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "stop_token_ids must be non-negative integers"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise SamplingParamsError(name, message)

    def _check_types(self) -> None:
        """Normalise the containers and refuse values of the wrong type before any range check;
        oversized lists are refused before they are walked."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError("stop", f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} "
                                              "are allowed")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError("stop_token_ids", f"stop_token_ids has {len(self.stop_token_ids)} ids; at "
                                                        f"most {MAX_STOP_TOKEN_IDS} are allowed")
        if not all(isinstance(s, str) for s in self.stop):
            raise SamplingParamsError("stop", "stop must be a list of non-empty strings")
        self.stop_token_ids = [_as_int("stop_token_ids", t) for t in self.stop_token_ids]
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamsError("structured_outputs", "structured_outputs must be a StructuredOutputsParams")
        for name in ("n", "top_k", "min_tokens"):
            setattr(self, name, _as_int(name, getattr(self, name)))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "best_of"):
            value = getattr(self, name)
            if value is not None:  # a seed may be any 64-bit pattern, signed or not
                setattr(self, name, _as_int(name, value, UINT64_MAX if name == "seed" else INT64_MAX))
        self._check_logit_bias()
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
        for name in floats:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SamplingParamsError(name, f"{name} must be a finite number, got {value!r}")

    def _check_vllm_options(self) -> None:
        """vLLM's further options: the implemented ones' values, and the rest refused unless at their
        defaults, naming the reason."""
        for name, (default, reason) in _UNSUPPORTED.items():
            if getattr(self, name) != default:
                raise SamplingParamsError(name, f"{name} is not supported: {reason}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise SamplingParamsError("output_kind", "output_kind must be a RequestOutputKind")
        words = [] if self.bad_words is None else self.bad_words
        if isinstance(words, str) or not all(isinstance(w, str) and w.strip() for w in words):
            raise SamplingParamsError("bad_words", "bad_words must be a list of non-empty strings")
        self.bad_words = list(dict.fromkeys(words))
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise SamplingParamsError("bad_words", f"bad_words has {len(self.bad_words)} words; at most "
                                                   f"{MAX_BAD_WORDS} are allowed")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [_as_int("allowed_token_ids", t) for t in self.allowed_token_ids]
            if not self.allowed_token_ids or min(self.allowed_token_ids) < 0:
                raise SamplingParamsError("allowed_token_ids", "allowed_token_ids must be a non-empty list of "
                                                               "token ids")
        if self.stop and not self.detokenize:
            raise SamplingParamsError("stop", "stop strings need detokenize=True: they are found in the text")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise SamplingParamsError("extra_args", "extra_args must be a dict")

    def _check_logit_bias(self) -> None:
        """``{token id: bias}`` with ids as ints (OpenAI sends them as strings) and biases in [-100, 100]."""
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise SamplingParamsError("logit_bias", "logit_bias must be a mapping of token ids to biases")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingParamsError("logit_bias", f"logit_bias has {len(self.logit_bias)} entries; at most "
                                                    f"{MAX_LOGIT_BIAS} are allowed")
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key) if isinstance(key, str) else _as_int("logit_bias", key)
            except ValueError:
                raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise SamplingParamsError("logit_bias", f"logit_bias values must be numbers in [-100, 100], got "
                                                        f"{value!r} for token {key!r}")
            if token < 0:
                raise SamplingParamsError("logit_bias", f"logit_bias token ids must be >= 0, got {token}")
            bias[token] = float(value)
        self.logit_bias = bias or None

    @property
    def num_seqs(self) -> int:
        """Sequences generated for the request: best_of if set, else n."""
        return self.best_of or self.n

    @property
    def needs_logprobs(self) -> bool:
        """The sampled tokens' logprobs are computed: asked for, or needed to rank best_of candidates."""
        return self.logprobs is not None or self.num_seqs > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass
class BeamSearchParams:
    """Options of ``LLM.beam_search`` (vLLM's names and defaults): keep ``beam_width`` sequences, each step
    extended by one token, for at most ``max_tokens`` tokens; rank by cumulative logprob divided by
    length ** ``length_penalty``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        # each step asks for 2 * beam_width candidates per beam, and logprobs go up to 20
        if not (isinstance(self.beam_width, int) and 1 <= self.beam_width <= 10):
            raise SamplingParamsError("beam_width", f"beam_width must be an integer in [1, 10], got {self.beam_width}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise SamplingParamsError("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingParamsError("temperature", f"temperature must be in [0, {MAX_TEMPERATURE:g}], "
                                                     f"got {self.temperature}")
        if not math.isfinite(self.length_penalty):
            raise SamplingParamsError("length_penalty", f"length_penalty must be finite, got {self.length_penalty}")
