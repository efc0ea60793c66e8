"""Request fields the server does not use: which ones it ignores on purpose, and how that is logged.

Routers in front of vLLM-compatible servers (sglang-router, vllm-router) add SGLang's request fields to
every request they forward; logging them per request buried the log (280 lines for 80 requests). A field
name is therefore logged once per process, the first time a request carries it: at INFO when it is one
of :data:`IGNORED_FIELDS` (known, and without effect here), at WARNING otherwise.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

logger = logging.getLogger("iterserve.server.protocol")  # the name clients' log filters already use

# Fields SGLang's OpenAI protocol (python/sglang/srt/entrypoints/openai/protocol.py) and the routers add,
# which change nothing this server computes: reasoning display switches (no reasoning parser here), request
# ids, LoRA/session/PD-disaggregation routing, multimodal knobs, debugging outputs.
IGNORED_FIELDS: frozenset[str] = frozenset({
    # reasoning output switches (vLLM's deprecated include_reasoning, SGLang's pair)
    "include_reasoning", "separate_reasoning", "stream_reasoning", "reasoning_effort",
    # SGLang stop handling and debugging outputs
    "no_stop_trim", "return_hidden_states", "return_text_in_logprobs", "return_routed_experts",
    "return_cached_tokens_details",
    # request identity, priority and cache keys
    "rid", "request_id", "priority", "extra_key", "cache_salt", "data_parallel_rank",
    # LoRA and sessions (this server loads no adapters and keeps no sessions)
    "lora_path", "session_params",
    # prefill/decode disaggregation (the router's bootstrap rendezvous)
    "bootstrap_host", "bootstrap_port", "bootstrap_room",
    # SGLang multimodal controls (this server takes text only)
    "max_dynamic_patch", "min_dynamic_patch", "use_audio_in_video",
    # SGLang custom sampling hooks (code shipped in the request; never run here)
    "custom_logit_processor", "custom_params",
})

MAX_NAMED = 20  # a log line names at most this many fields
MAX_REMEMBERED = 1024  # names kept; past this, new names go unlogged (a client cannot grow the set for ever)

_seen: set[str] = set()
_seen_lock = threading.Lock()  # bodies are validated in FastAPI's thread pool


def report_ignored(names: Iterable[str]) -> None:
    """Log the names among ``names`` that no earlier request carried (once per name per process)."""
    with _seen_lock:
        new = sorted(set(names) - _seen)[:max(0, MAX_REMEMBERED - len(_seen))]
        _seen.update(new)
    if not new:
        return
    known = [n for n in new if n in IGNORED_FIELDS]
    unknown = [n for n in new if n not in IGNORED_FIELDS]
    if known:
        logger.info("Ignoring request fields that routers and SGLang clients send (logged once): %s",
                    _named(known))
    if unknown:
        logger.warning("The following fields were present in the request but ignored (each is logged once): %s",
                       _named(unknown))


def _named(names: list[str]) -> list[str]:
    return names[:MAX_NAMED] + (["..."] if len(names) > MAX_NAMED else [])


def forget_reported() -> None:
    """Log every field again on its next appearance (tests)."""
    with _seen_lock:
        _seen.clear()
