"""Structured-output grammars proven runnable before a request is admitted, off the event loop.

The route builds a request's constraint without checking its grammar
(:func:`~iterserve.sampling_params.grammar_checks_deferred`), then :class:`GrammarChecker` compiles it
against the model's vocabulary on a :class:`~iterserve.engine.structured_output.GrammarPool` (worker
threads: llguidance releases the GIL) with a time limit. A grammar that does not compile, cannot run
(found by computing its first mask and taking one token) or takes longer than the limit is refused
with a 400 naming the parameter, before the request is queued or any prompt is computed; meanwhile
the server answers everyone else. Compiled grammars are kept, so a schema sent again is not compiled again.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

from iterserve.engine.structured_output import GrammarCompiler, GrammarPool
from iterserve.sampling_params import StructuredOutputsParams
from iterserve.server.errors import bad_request
from iterserve.tokenizer import Tokenizer


class GrammarChecker:
    """Proves grammars runnable for the server: ``workers`` threads, ``timeout`` seconds per grammar."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, workers: int, timeout: float) -> None:
        self.pool = GrammarPool(tokenizer, vocab_size, workers)
        self.timeout = timeout
        self._compiler: Future[GrammarCompiler] | None = None

    async def check(self, spec: StructuredOutputsParams | None, param: str) -> None:
        """Return once ``spec``'s grammar is proven to run; a 400 naming ``param`` when it is not."""
        if spec is None:
            return
        if self._compiler is None:  # built once (1-2 s), not counted against the first grammar's limit
            self._compiler = self.pool.start()
        try:
            await asyncio.wrap_future(self._compiler)
            await asyncio.wait_for(asyncio.wrap_future(self.pool.submit(spec)), self.timeout)
        except TimeoutError:  # a queued compile is dropped; a running one finishes (llguidance's fuel bounds it)
            raise bad_request(f"{param}: the grammar did not compile within {self.timeout:g} s; simplify it",
                              param, "grammar_too_complex") from None
        except ValueError as e:
            raise bad_request(f"{param}: {e}", param) from e

    def close(self) -> None:
        self.pool.close()
