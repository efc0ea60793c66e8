"""Speculative decoding's settings, spelled as vLLM's ``speculative_config``.

``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}``
proposes the k tokens that followed the latest earlier occurrence of the sequence's last a..b tokens;
``{"model": "<name or path>", "num_speculative_tokens": k}`` runs a small draft model with the same
vocabulary. The same dictionary comes from ``LLM(speculative_config={...})``, from the command line's
``--speculative-config JSON``, and back from a worker's JSON copy of the engine's config.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from iterserve.config.dtypes import Quantization
from iterserve.config.json_option import json_object

SpecMethod = Literal["ngram", "draft_model"]

# vLLM's default n-gram window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5

# Running sequences above which a step verifies no drafts: while a pass is bound by reading the weights,
# k+1 tokens per sequence cost about what one does; once it is compute-bound rejected drafts are paid in
# full. Measured on the copy workload (docs/benchmarks-history.md, 2026-12-02 and 2026-12-03, an EPYC with
# AVX-512): speculation still gave 1.07x (k=4) and 1.25x (k=8) at 16 running, and 0.92x at 32 (k=8).
DEFAULT_DISABLE_BY_BATCH_SIZE = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which proposer drafts tokens and how many; checked once, when built."""

    num_speculative_tokens: int
    method: SpecMethod = "ngram"
    model: str | None = None  # the draft model (method "draft_model")
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # vLLM's name: no drafts are verified in a step whose running batch is larger than this.
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    # vLLM's name: the draft's weights kept quantized (gguf or int8), whatever the target's are. A draft of
    # the target's own file in gguf blocks reads a fifth of float32's bytes per pass.
    quantization: Quantization | None = None

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config: method must be 'ngram' or 'draft_model', got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: a draft model needs 'model' (a name, a .gguf file, a folder or "
                             "random:<preset>)")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config: 'model' means a draft model; n-gram lookup takes none")
            low = self.prompt_lookup_min if self.prompt_lookup_min is not None else self.prompt_lookup_max
            high = self.prompt_lookup_max if self.prompt_lookup_max is not None else low
            low = DEFAULT_PROMPT_LOOKUP if low is None else low
            high = DEFAULT_PROMPT_LOOKUP if high is None else high
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
            if low > high:
                raise ValueError(f"speculative_config: prompt_lookup_min ({low}) exceeds prompt_lookup_max ({high})")
        if self.quantization is not None and self.quantization not in typing.get_args(Quantization):
            raise ValueError(f"speculative_config: quantization must be "
                             f"{' or '.join(map(repr, typing.get_args(Quantization)))}, got {self.quantization!r}")
        if self.quantization is not None and not self.model:
            raise ValueError("speculative_config: quantization applies to a draft model; n-gram lookup has no weights")
        limit = self.disable_by_batch_size
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 1, got {limit!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from vLLM's dictionary, its JSON text (the command line's), or None for no speculation.

        ``method`` may be left out: a dictionary with a ``model`` is a draft model, one without is n-gram.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        given = json_object(value, "speculative_config", (f.name for f in dataclasses.fields(cls)))
        if given is None:
            return None
        if "num_speculative_tokens" not in given:
            raise ValueError("speculative_config needs num_speculative_tokens")
        fields = dict(given)
        fields.setdefault("method", "draft_model" if fields.get("model") else "ngram")
        return cls(**fields)

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"
