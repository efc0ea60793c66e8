"""Structured output: a request's constraint compiled by llguidance and matched token by token.

A :class:`~iterserve.sampling_params.StructuredOutputsParams` (JSON schema, any JSON object, regex,
choice or Lark grammar) is checked where the request is made (it knows its own grammar, no vocabulary
needed) and compiled against the model's vocabulary (:class:`GrammarCompiler`): by the server before
it admits the request, to prove that the grammar runs, and by the engine core, which runs it. Each
constrained sequence (each of a request's n or best_of) holds its own :class:`GrammarMatcher`: before a
step it writes the tokens the grammar allows next into a packed bitmask row that the sampler applies;
after the step it consumes the sampled token, and once the grammar admits nothing more the sequence ends.

Compiling takes from microseconds to tens of seconds (50,000 choices: 25 s), so it runs on worker
threads (:class:`GrammarPool`; llguidance releases the GIL while it compiles and computes masks), never
on an event loop or the core's step loop, and compiled grammars are kept (least recently used out), so
a schema sent again is copied, not compiled.

llguidance was chosen over xgrammar because it installs as one wheel with no dependencies (xgrammar
pulls transformers and, on x86 Linux, triton), reads the ``tokenizers`` JSON directly, and computes
a mask without a per-schema precompilation pass; docs/structured_output.md has the numbers.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from iterserve.sampling_params import StructuredOutputsParams
from iterserve.tokenizer import Tokenizer

GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept per compiler
# A request's grammar work (masks and token checks, all its sequences together) may take this long at first
# (the first masks build lexer states) plus this long per token generated: an ambiguous grammar's steps grow
# with the text, and past its budget it ends with an error instead of slowing the whole batch.
GRAMMAR_BUDGET_START_S = 0.25
GRAMMAR_BUDGET_PER_TOKEN_S = 0.001
# Within a step a request's masks may take this share of the step's model work, or this long per mask if more
# (a realistic mask takes well under a millisecond); over that this many steps running, the request ends.
GRAMMAR_STEP_FACTOR = 0.5
GRAMMAR_STEP_FLOOR_PER_MASK_S = 0.002
GRAMMAR_STEP_STRIKES = 4
# Earley items one mask may build: an ambiguous grammar's items grow with every token, so a mask that needs
# more fails at once (llguidance's default is 50,000; the realistic grammars in scripts/bench_structured_output.py
# never reach 10,000).
GRAMMAR_STEP_MAX_ITEMS = 10_000


@dataclass
class GrammarBudget:
    """The grammar time a request has left, shared by its sequences: in all, and within each step."""

    start_s: float = GRAMMAR_BUDGET_START_S
    per_token_s: float = GRAMMAR_BUDGET_PER_TOKEN_S
    spent_s: float = 0.0
    tokens: int = 0
    step_s: float = 0.0  # this step's mask time so far
    step_masks: int = 0
    strikes: int = 0  # steps running whose masks took longer than the step allowed

    def charge_mask(self, seconds: float) -> None:
        self.spent_s += seconds
        self.step_s += seconds
        self.step_masks += 1

    def end_step(self, model_s: float) -> None:
        """Close a step whose model work (forward pass and sampling) took ``model_s``."""
        allowed = max(GRAMMAR_STEP_FACTOR * model_s, GRAMMAR_STEP_FLOOR_PER_MASK_S * self.step_masks)
        self.strikes = self.strikes + 1 if self.step_s > allowed else 0
        self.step_s, self.step_masks = 0.0, 0

    @property
    def exhausted(self) -> bool:
        return (self.spent_s > self.start_s + self.per_token_s * self.tokens
                or self.strikes >= GRAMMAR_STEP_STRIKES)

    def describe(self) -> str:
        """Why the request was ended, for its error message."""
        if self.strikes >= GRAMMAR_STEP_STRIKES:
            return (f"the request's grammar took over {GRAMMAR_STEP_FACTOR:g}x the model's time in {self.strikes} "
                    f"steps running ({self.spent_s:.2f} s for {self.tokens} tokens)")
        return (f"the request's grammar took {self.spent_s:.2f} s for {self.tokens} tokens, over its budget of "
                f"{self.start_s:g} s + {self.per_token_s * 1000:g} ms a token")


class GrammarMatcher:
    """One sequence's position in its grammar; the time it takes is charged to its request's budget."""

    def __init__(self, matcher: llguidance.LLMatcher, grammar_eos: int, budget: GrammarBudget | None = None) -> None:
        self._matcher = matcher
        self._grammar_eos = grammar_eos
        self.budget = budget if budget is not None else GrammarBudget()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, stop_ids: Iterable[int]) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, contiguous, on the CPU).

        The request's stop tokens (EOS included) are allowed exactly when the grammar accepts what
        has been generated, so a request can only end early on a complete value.
        """
        view = bitmask[row]
        start = time.perf_counter()
        self._matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())
        self.budget.charge_mask(time.perf_counter() - start)
        words = view.numpy().view(np.uint32)
        if self._matcher.is_error():  # a limit hit: any token, so the row samples; the scheduler ends the sequence
            words[:] = np.uint32(0xFFFFFFFF)
            return
        accepting = self._matcher.is_accepting()
        stops = set(stop_ids)
        for token in stops | {self._grammar_eos}:
            word, bit = divmod(token, 32)
            if word < len(words):
                if accepting and token in stops:
                    words[word] |= np.uint32(1 << bit)
                else:
                    words[word] &= ~np.uint32(1 << bit)

    def copy(self) -> GrammarMatcher:
        """An independent matcher at the same position: each of a request's n sequences advances its own."""
        return GrammarMatcher(self._matcher.deep_copy(), self._grammar_eos, self.budget)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False (and the matcher is broken) if the grammar forbids it."""
        start = time.perf_counter()
        accepted = self._matcher.consume_token(token)
        self.budget.spent_s += time.perf_counter() - start
        self.budget.tokens += 1
        return accepted

    @property
    def failure(self) -> str | None:
        """Why this sequence must end with an error: its request's grammar is over its time budget
        (:class:`GrammarBudget`) or a mask failed (past llguidance's limits); None while it may go on."""
        if self._matcher.is_error():
            reason = self._matcher.get_error().splitlines()[0]
            return f"the grammar engine stopped the request's grammar ({reason})"
        if self.budget.exhausted:
            return self.budget.describe()
        return None

    @property
    def is_terminated(self) -> bool:
        """Nothing but the end of the request can follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GrammarCompiler:
    """Compiles constraints against one model's vocabulary, keeping the last ``cache_size`` compiled; safe
    to call from several threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(tokenizer.eos_token_ids, default=0)
        self._ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        self._eos = eos
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.num_compiled = 0
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._limits = llguidance.LLParserLimits(step_max_items=GRAMMAR_STEP_MAX_ITEMS)

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of ``spec``'s grammar, copied from the cache or compiled; raises
        ValueError if it does not compile or cannot run."""
        kind = spec.kind
        try:
            grammar = spec.ll_grammar()
        except ValueError as e:
            raise ValueError(f"invalid {kind}: {e}") from None
        key = (kind, grammar)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
        if template is None:
            template = self._compile(kind, grammar)
            with self._lock:
                self._cache[key] = template
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return GrammarMatcher(template.deep_copy(), self._eos)

    def _compile(self, kind: str, grammar: str) -> llguidance.LLMatcher:
        """Compile ``grammar`` and prove it runs: llguidance finds some faults (a rule that only refers to
        itself, a literal repeated a million times) only when it computes a mask or takes a token, so the
        first mask is computed (which also builds the lexer states every copy then shares) and one allowed
        token is taken, on a copy."""
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0, limits=self._limits)
        error = matcher.get_error() if matcher.is_error() else ""
        if not error:
            mask = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
            token = next((int(t) for t in allowed if t != self._eos), None)
            if matcher.is_error():
                error = matcher.get_error()
            elif token is not None and not (probe := matcher.deep_copy()).consume_token(token):
                error = probe.get_error()
        if error:
            raise ValueError(f"invalid {kind}: {error.splitlines()[0]}")
        self.num_compiled += 1
        return matcher


class GrammarPool:
    """Compiles on ``workers`` threads, so that neither the server's event loop nor the core's step loop
    waits for a grammar; the compiler (1-2 s to build for a 49k vocabulary) is built by the first job."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, workers: int = 2) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="grammar")

    def compiler(self) -> GrammarCompiler:
        """The compiler, built on first use; raises ValueError for a model without a tokenizer."""
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer, and this model has none")
                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size)
            return self._compiler

    def start(self) -> Future[GrammarCompiler]:
        """Build the compiler on a worker, ahead of the first grammar."""
        return self._executor.submit(self.compiler)

    def submit(self, spec: StructuredOutputsParams) -> Future[GrammarMatcher]:
        """A matcher for ``spec``, compiled on a worker; the future raises ValueError if it cannot run."""
        return self._executor.submit(lambda: self.compiler().matcher(spec))

    def close(self) -> None:
        """Drop queued jobs; one already running finishes on its own (llguidance's limits bound it)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
