"""The engine's, the scheduler's and the server's settings.

``EngineConfig``, ``SchedulerConfig`` and ``ServerConfig`` are frozen and validated once, when built;
their fields' metadata carries the help text the command line shows, so a new setting is one new field
(:func:`iterserve.cli.flags.add_config_args` turns fields into flags).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from iterserve.config.dtypes import Quantization, parse_dtype
from iterserve.config.kv_cache import KVCacheDtype, canonical_kv_cache_dtype
from iterserve.config.kv_events import KVEventsConfig
from iterserve.config.model import DEFAULT_MODEL
from iterserve.config.speculative import SpeculativeConfig

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Batching = Literal["continuous", "static", "dynamic"]
KVAllocation = Literal["paged", "reserved"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
DataParallelBackend = Literal["mp", "ray"]
LOG_LEVELS: tuple[str, ...] = typing.get_args(LogLevel)
# The sampler returns at most this many top alternatives per token (vLLM's default --max-logprobs).
MAX_LOGPROBS = 20


def _opt(default: Any, text: str, **cli: Any) -> Any:
    """A field with its command-line help (and optional flag settings: ``flag``, ``env``, ``cli=False``)."""
    return field(default=default, metadata={"help": text, **cli})


def _same_as(cls: Any, name: str) -> Any:
    """A field declared like ``cls``'s field ``name`` (one home for its default and help)."""
    f = cls.__dataclass_fields__[name]
    return field(default=f.default, metadata=f.metadata)


def _canonical_dtype(name: str) -> str:
    """'fp32', 'bf16', 'half', ... -> the canonical name; 'auto' stays (resolved when the model loads)."""
    if str(name).lower() == "auto":
        return "auto"
    return str(parse_dtype(name)).removeprefix("torch.")


def _check_positive(obj: Any, *names: str, allow_none: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is None and allow_none:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _check_choice(obj: Any, name: str, kind: Any) -> None:
    choices = typing.get_args(kind)
    if getattr(obj, name) not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {getattr(obj, name)!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may put in one step, and how it admits and holds requests."""

    max_num_seqs: int = _opt(256, "most sequences in one step's batch")
    max_num_batched_tokens: int = _opt(2048, "most tokens (prefill chunks + decodes) computed in one step")
    batching: Batching = _opt("continuous", "continuous: requests join and leave at every step; static: a new "
                                            "batch starts only when the previous one has finished; dynamic: as "
                                            "static, but a new batch waits for --max-num-seqs requests or for its "
                                            "first to have waited --max-batch-wait seconds")
    max_batch_wait: float = _opt(0.05, "dynamic batching: seconds the oldest waiting request may wait for its batch "
                                       "to fill before the batch starts")
    kv_allocation: KVAllocation = _opt("paged", "paged: KV blocks as tokens arrive; reserved: blocks for "
                                                "prompt + max_tokens (each of n) held from admission")
    max_model_len: int | None = _opt(None, "a sequence reaching this many tokens finishes with 'length'", cli=False)
    max_loras: int | None = _opt(None, "most LoRA adapters in one step's batch (None: LoRA is off)", cli=False)

    def __post_init__(self) -> None:
        _check_positive(self, "max_num_seqs", "max_num_batched_tokens")
        _check_positive(self, "max_model_len", "max_loras", allow_none=True)
        _check_choice(self, "batching", Batching)
        _check_choice(self, "kv_allocation", KVAllocation)
        if isinstance(self.max_batch_wait, bool) or not isinstance(self.max_batch_wait, (int, float)) \
                or not 0 <= self.max_batch_wait < float("inf"):
            raise ValueError(f"max_batch_wait must be a number of seconds >= 0, got {self.max_batch_wait!r}")


@dataclass(frozen=True)
class EngineConfig:
    """One engine: the model, its precision and device, the KV pool and the scheduler's limits."""

    model: str = _opt(DEFAULT_MODEL, "embedded model name, .gguf file, Hugging Face folder, or random:<preset>")
    dtype: Dtype = _opt("auto", "weights and KV cache precision; auto is bfloat16 where the hardware computes in "
                                "it, else float32")
    device: str | None = _opt(None, "cpu, cuda or cuda:N (default: cuda when available)")
    quantization: Quantization | None = _opt(None, "weights kept quantized: gguf keeps a GGUF file's quantized "
                                                   "blocks (Q4_0..Q8_0, K-quants), int8 quantizes a float "
                                                   "checkpoint at load (default: float weights in --dtype)")
    block_size: int = _opt(16, "tokens per KV cache block")
    max_model_len: int | None = _opt(None, "longest prompt + output (default: the model's context, capped by "
                                           "what the KV pool holds)")
    max_num_seqs: int = _same_as(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int = _same_as(SchedulerConfig, "max_num_batched_tokens")
    enable_prefix_caching: bool = _opt(True, "reuse the KV blocks of prompt prefixes seen before",
                                       flag="--prefix-caching")
    kv_cache_memory: str | int = _opt("2GiB", "KV pool size, e.g. 2GiB or 512MiB")
    num_kv_blocks: int | None = _opt(None, "KV pool size in blocks (overrides --kv-cache-memory)")
    hybrid_swa_memory: bool = _opt(True, "a model with sliding-window layers (Gemma 3, Mistral v0.1, Phi-3-mini-4k) "
                                         "keeps their K/V in a pool of their own and frees the blocks that fall out "
                                         "of the window")
    swa_full_tokens_ratio: float = _opt(0.8, "hybrid SWA memory: tokens the windowed layers' pool holds per token of "
                                             "the full layers' pool (at most what max_num_seqs windows need)")
    kv_cache_dtype: KVCacheDtype = _opt("auto", "KV cache storage: auto (the model's dtype); fp8 (= fp8_e4m3) or "
                                                "fp8_e5m2, one byte per value; int8, one byte per value and a "
                                                "float16 scale per token and KV head. The 1-byte kinds hold about "
                                                "twice the tokens of bf16 in the same memory")
    batching: Batching = _same_as(SchedulerConfig, "batching")
    max_batch_wait: float = _same_as(SchedulerConfig, "max_batch_wait")
    kv_allocation: KVAllocation = _same_as(SchedulerConfig, "kv_allocation")
    tensor_parallel_size: int = _opt(1, "split every layer over this many processes (tensor parallelism); "
                                        "under torchrun, the launcher's WORLD_SIZE")
    max_logprobs: int = _opt(MAX_LOGPROBS, "most top alternatives a request may ask for per token (logprobs, "
                                           f"top_logprobs, prompt_logprobs), as vLLM's; at most {MAX_LOGPROBS}")
    seed: int = _opt(0, "seed of random weights and of sampling without a per-request seed")
    step_trace: str | None = _opt(None, "write a JSON-lines trace of every step and request to this file")
    load_progress: bool = _opt(True, "count the weights on stderr while the model loads (drawn only where stderr "
                                     "is a terminal)")
    step_history: int = _opt(0, "keep the last N steps' StepStats in memory (benchmarks, tests)", cli=False)
    speculative_config: SpeculativeConfig | None = _opt(
        None, 'speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_min": 2, "prompt_lookup_max": 5} or {"model": "<draft>", "num_speculative_tokens": 4}',
        type=SpeculativeConfig.parse)
    kv_events_config: KVEventsConfig | None = _opt(
        None, 'publish the prefix cache\'s KV-block events for KV-aware routers, as vLLM\'s JSON: '
              '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"} (also '
              'replay_endpoint, buffer_steps, hwm, max_queue_size, topic); replica i of a data-parallel server '
              'publishes on the port + i', type=str)
    enable_lora: bool = _opt(False, "serve LoRA adapters of the model (PEFT folders), many in one batch; a request "
                                    "names its adapter (LLM.generate(lora_request=...))")
    max_loras: int = _opt(1, "most LoRA adapters in one step's batch, and held loaded at once")
    max_lora_rank: int = _opt(16, "highest LoRA rank an adapter may have")

    def __post_init__(self) -> None:
        # aliases (fp32, bf16, half) are accepted and stored under their one canonical name
        object.__setattr__(self, "dtype", _canonical_dtype(self.dtype))
        # a dict (LLM(speculative_config={...}), a worker's JSON copy) or JSON text (the command line)
        spec = SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        # the same forms as speculative_config; JSON text is parsed here so that its error is one line
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        if spec is not None and spec.uses_draft_model and self.tensor_parallel_size > 1:
            raise ValueError("a speculative draft model runs with tensor_parallel_size=1 only; n-gram speculation "
                             "works with any")
        _check_positive(self, "block_size", "tensor_parallel_size", "max_loras", "max_lora_rank")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters run with tensor_parallel_size=1 only")
        canonical_kv_cache_dtype(self.kv_cache_dtype)  # an unknown value fails here, listing the accepted ones
        object.__setattr__(self, "kv_cache_dtype", str(self.kv_cache_dtype).lower())
        _check_positive(self, "max_model_len", "num_kv_blocks", allow_none=True)
        if self.quantization is not None:
            _check_choice(self, "quantization", Quantization)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) \
                or not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be an integer in [0, {MAX_LOGPROBS}] (the sampler returns at most "
                             f"{MAX_LOGPROBS} alternatives), got {self.max_logprobs!r}")
        ratio = self.swa_full_tokens_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"swa_full_tokens_ratio must be a number in (0, 1], got {ratio!r}")
        if not isinstance(self.step_history, int) or self.step_history < 0:
            raise ValueError(f"step_history must be an integer >= 0, got {self.step_history!r}")
        self.scheduler_config(self.max_model_len)  # the scheduler's fields are checked where they are defined

    @property
    def resolved_device(self) -> str:
        """Where the model runs: ``device``, or cuda where available, else cpu (the loader's choice), so that
        what is shown is the device in use, never an unset default."""
        import torch  # torch loads with the engine, not with the settings

        return self.device or ("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def resolved_dtype(self) -> str:
        """The dtype the weights load in: ``dtype``, with ``auto`` resolved as the loader resolves it (bfloat16
        where the hardware computes in it, else float32), so that what is shown is never ``auto``."""
        return str(parse_dtype(self.dtype)).removeprefix("torch.")

    def scheduler_config(self, max_model_len: int | None) -> SchedulerConfig:
        """The scheduler's share of this config, with max_model_len resolved against the KV pool."""
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.batching, self.max_batch_wait,
                               self.kv_allocation, max_model_len, self.max_loras if self.enable_lora else None)


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side of ``iterserve serve``: where it listens, whom it lets in, and its limits."""

    host: str = _opt("127.0.0.1", "address to bind (loopback unless told otherwise)")
    port: int = _opt(8000, "port to listen on")
    api_key: str | None = _opt(None, "require 'Authorization: Bearer KEY' on every route but /health, /metrics and "
                                     "/version (default: $ITERSERVE_API_KEY)", env="ITERSERVE_API_KEY")
    served_model_name: str | None = _opt(None, "model name clients use (default: the --model value)")
    max_waiting: int = _opt(256, "requests allowed to wait for the batch; more are refused with 429")
    # Room for a 128k-token prompt several times over, however the JSON spells it (a token id takes
    # about 7 bytes, a non-ASCII character escaped as \uXXXX 6). FastAPI parses JSON on the event loop:
    # the worst case this allows, 8 MiB of token ids, held it for 0.7 s on a busy two-core machine.
    max_request_body_bytes: int = _opt(8 * 1024 * 1024, "request bodies larger than this are refused with 413")
    shutdown_timeout: float = _opt(5.0, "seconds running requests may take to finish after SIGTERM before they "
                                        "are ended")
    data_parallel_size: int = _opt(1, "engine cores (replicas) behind this server, each with its own KV pool; "
                                      "a request goes to the one most likely to hold its prompt's prefix, then "
                                      "to the least loaded (on CUDA replica i runs on cuda:i)")
    data_parallel_backend: DataParallelBackend = _opt("mp", "where the data-parallel engine cores run: mp, local "
                                                            "processes; ray, Ray actors of one CPU each, spread "
                                                            "over the Ray cluster's nodes (RAY_ADDRESS, default "
                                                            "auto; needs ray installed)")
    # 8 MiB at 300 KB/s; a client that sends less has its connection closed rather than held open
    request_body_timeout: float = _opt(30.0, "seconds a client may take to send a request body; slower ones get "
                                             "408 and the connection is closed")
    # well above one step: a full prefill chunk on a busy CPU takes seconds, not a minute
    engine_stall_timeout: float = _opt(60.0, "/health answers 503 when an engine core has requests and has sent "
                                             "nothing back for this many seconds")
    max_engine_restarts: int = _opt(3, "times an engine core that dies is started again within 10 minutes (its "
                                       "requests fail; the other replicas carry on); once more and the server "
                                       "exits 1 for its supervisor; 0: exit at the first death")
    max_dashboard_viewers: int = _opt(16, "dashboard feeds open at once; more are refused with 429")
    grammar_workers: int = _opt(2, "threads that check structured-output grammars before requests are admitted")
    grammar_timeout: float = _opt(10.0, "seconds a structured-output grammar may take to compile; slower ones are "
                                        "refused with 400")
    # the API process builds and sends every entry: this bounds that work (figures in docs/compatibility.md)
    max_response_logprobs: int = _opt(2**17, "logprob entries one response may carry (choices x tokens x "
                                             "(top alternatives + 1), prompt logprobs too); requests that could "
                                             "return more are refused with 400")
    log_level: LogLevel = _opt("INFO", "log level of the server and its engine core", cli=False)
    chat_template: str | None = _opt(None, "chat template used instead of the model's: a file, or the template "
                                           "itself (as vLLM takes it); a request's chat_template still wins")
    lora_modules: tuple[str, ...] = _opt((), "LoRA adapters served beside the model, as vLLM's name=path ...: a "
                                             "request's \"model\": \"<name>\" runs under that adapter (needs "
                                             "--enable-lora)", type=str, nargs="+")

    def __post_init__(self) -> None:
        _check_positive(self, "max_waiting", "max_request_body_bytes", "data_parallel_size", "max_dashboard_viewers",
                        "grammar_workers", "max_response_logprobs")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.data_parallel_backend not in typing.get_args(DataParallelBackend):
            raise ValueError(f"data_parallel_backend must be 'mp' or 'ray', got {self.data_parallel_backend!r}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout!r}")
        if isinstance(self.max_engine_restarts, bool) or not isinstance(self.max_engine_restarts, int) \
                or self.max_engine_restarts < 0:
            raise ValueError(f"max_engine_restarts must be an integer >= 0, got {self.max_engine_restarts!r}")
        for name in ("request_body_timeout", "engine_stall_timeout", "grammar_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        object.__setattr__(self, "log_level", str(self.log_level).upper())
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules or ()))
        self.lora_paths()  # a malformed name=path is refused at start
        _check_choice(self, "log_level", LogLevel)

    def lora_paths(self) -> dict[str, str]:
        """``{adapter name: its PEFT folder}`` from ``lora_modules``, in the order given."""
        paths: dict[str, str] = {}
        for module in self.lora_modules:
            name, sep, path = str(module).partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules takes name=path entries, got {module!r}")
            if name in paths:
                raise ValueError(f"LoRA adapter name {name!r} is given twice")
            paths[name] = path
        return paths

    def model_name(self, engine: EngineConfig) -> str:
        """The name clients ask for: ``served_model_name``, else the engine's model."""
        return self.served_model_name or engine.model
