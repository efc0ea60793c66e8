"""Structured output: a request's constraint compiled by llguidance and matched token by token.

A :class:`~iterserve.sampling_params.StructuredOutputsParams` (JSON schema, any JSON object, regex,
choice or Lark grammar) is checked where the request is made (it knows its own grammar, no vocabulary
needed) and compiled in the engine core against the model's vocabulary (:class:`GrammarCompiler`,
one per core). Each constrained sequence holds a :class:`GrammarMatcher`: before a step it writes the
tokens the grammar allows next into a packed bitmask row that the sampler applies; after the step it
consumes the sampled token, and once the grammar admits nothing more the request ends.

llguidance was chosen over xgrammar because it installs as one wheel with no dependencies (xgrammar
pulls transformers and, on x86 Linux, triton), reads the ``tokenizers`` JSON directly, and computes
a mask without a per-schema precompilation pass; docs/structured_output.md has the numbers.
"""

from __future__ import annotations

from collections.abc import Iterable

import llguidance
import numpy as np
import torch

from iterserve.sampling_params import StructuredOutputsParams
from iterserve.tokenizer import Tokenizer


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, grammar_eos: int) -> None:
        self._matcher = matcher
        self._grammar_eos = grammar_eos

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, stop_ids: Iterable[int]) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, contiguous, on the CPU).

        The request's stop tokens (EOS included) are allowed exactly when the grammar accepts what
        has been generated, so a request can only end early on a complete value.
        """
        view = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())
        words = view.numpy().view(np.uint32)
        accepting = self._matcher.is_accepting()
        stops = set(stop_ids)
        for token in stops | {self._grammar_eos}:
            word, bit = divmod(token, 32)
            if word < len(words):
                if accepting and token in stops:
                    words[word] |= np.uint32(1 << bit)
                else:
                    words[word] &= ~np.uint32(1 << bit)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False (and the matcher is broken) if the grammar forbids it."""
        return self._matcher.consume_token(token)

    @property
    def is_terminated(self) -> bool:
        """Nothing but the end of the request can follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GrammarCompiler:
    """Compiles constraints against one model's vocabulary; built once per engine core."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(tokenizer.eos_token_ids, default=0)
        self._ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        self._eos = eos
        self.vocab_size = vocab_size

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of ``spec``'s grammar; raises ValueError if it does not compile."""
        matcher = llguidance.LLMatcher(self._ll_tokenizer, spec.ll_grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind}: {matcher.get_error()}")
        return GrammarMatcher(matcher, self._eos)
