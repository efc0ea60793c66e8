"""Every setting in one place: the model's architecture, the engine, the scheduler and the server.

``ModelConfig`` describes a Llama-family decoder; it comes from a Hugging Face ``config.json``, from
GGUF metadata, or from a preset (the real shapes of well-known models, used with random weights and
by the capacity planner). ``EngineConfig``, ``SchedulerConfig`` and ``ServerConfig`` are frozen and
validated once, when built; their fields' metadata carries the help text the command line shows, so
a new setting is one new field (:func:`add_config_args` turns fields into flags).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

import torch

from iterserve.dtypes import canonical_dtype, torch_dtype

# The embedded model every command and ``LLM()`` runs when given none (resolved by models/loader.py).
DEFAULT_MODEL = "smollm2-135m"

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

_HF_ARCH_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

# the dtypes the engine runs in (keys of iterserve.dtypes.DTYPES, the one dtype table)
RUNNABLE_DTYPES = ("fp32", "bf16", "fp16")


# CPU flags (Linux /proc/cpuinfo) of bf16 matrix instructions. Without them torch emulates bf16: on a
# 2-core AVX2 EPYC a 64 x 576 by 576 x 1536 F.linear ran at 14.8 GFLOP/s in bf16 against 104 in
# float32, while AVX-512 bf16 machines run bf16 about twice as fast as float32.
_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bf16 matrix instructions (x86 AVX-512 BF16 / AMX, or Arm's BF16)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    return any(word in _BF16_CPU_FLAGS for line in cpuinfo.splitlines()
               if line.lower().startswith(("flags", "features")) for word in line.split())


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a user-facing dtype name to a torch dtype, with a clear error for anything else.

    ``auto`` is bfloat16 where the hardware computes in it (a CUDA device, a CPU with bf16
    instructions) and float32 elsewhere, where bf16 would only be emulated.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in {torch_dtype(key) for key in RUNNABLE_DTYPES}:
            return dtype
        raise ValueError(f"unsupported dtype {dtype}; choose one of auto, float32, bfloat16, float16")
    key = str(dtype).lower()
    if key == "auto":
        native = torch.cuda.is_available() or cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    try:
        canonical = canonical_dtype(key)
    except ValueError:
        canonical = None
    if canonical not in RUNNABLE_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, float32, bfloat16, float16")
    return torch_dtype(canonical)


@dataclass
class ModelConfig:
    """Shapes and hyper-parameters of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 puts a bias on q, k and v
    qk_norm: bool = False  # Qwen3 RMS-normalises q and k per head
    sliding_window: int | None = None  # Mistral v0.1 attends to the last N positions only
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; iterserve runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    # -- sizes used by the engine and the planner ------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for one token across all layers: layers x 2 x kv_heads x head_dim x bytes."""
        return self.num_layers * 2 * self.kv_size * dtype_bytes

    def num_parameters(self) -> int:
        """Exact parameter count of the decoder (embeddings counted once when tied)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h  # two RMSNorm weights
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + embed + lm_head + h  # final norm

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def tensor_parallel_shard(self, tp: int) -> ModelConfig:
        """The shapes one of ``tp`` tensor-parallel ranks holds (the Megatron split): a ``tp``-th of the
        heads, the MLP width and the vocabulary (rounded up; the last rank's rows are padding), and
        ``max(1, kv_heads / tp)`` KV heads, replicated when there are fewer KV heads than ranks.

        The engine sizes a rank's layers and KV cache from it, the planner a device's memory and work.
        Raises ValueError when the model does not split ``tp`` ways.
        """
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if tp == 1:
            return self
        label = self.name or self.architecture
        if self.num_heads % tp:
            raise ValueError(f"{label} has {self.num_heads} attention heads, which do not split over "
                             f"tensor_parallel_size={tp}")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ValueError(f"{label} has {self.num_kv_heads} KV heads: tensor_parallel_size={tp} must divide "
                             "them or be a multiple of them")
        if self.intermediate_size % tp:
            raise ValueError(f"{label}'s MLP width {self.intermediate_size} does not split over "
                             f"tensor_parallel_size={tp}")
        return self.replace(num_heads=self.num_heads // tp, num_kv_heads=max(1, self.num_kv_heads // tp),
                            intermediate_size=self.intermediate_size // tp, vocab_size=-(-self.vocab_size // tp))

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "") -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dictionary."""
        archs = cfg.get("architectures") or []
        arch = next((_HF_ARCH_NAMES[a] for a in archs if a in _HF_ARCH_NAMES), None)
        if arch is None:
            model_type = cfg.get("model_type")
            arch = model_type if model_type in SUPPORTED_ARCHITECTURES else None
        if arch is None:
            found = ", ".join(archs) or cfg.get("model_type") or "none"
            raise ValueError(
                f"unsupported architecture {found!r}; iterserve runs "
                f"{', '.join(sorted(_HF_ARCH_NAMES))}"
            )
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # newer transformers nest theta and scaling here
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (
            None,
            "default",
        ):
            rope_scaling = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            name=name or cfg.get("_name_or_path", ""),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The equivalent Hugging Face config dictionary (used to build reference models)."""
        arch_class = {v: k for k, v in _HF_ARCH_NAMES.items()}[self.architecture]
        cfg: dict[str, Any] = {
            "architectures": [arch_class],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.architecture in ("mistral", "qwen2", "qwen3"):
            cfg["sliding_window"] = self.sliding_window
            cfg["use_sliding_window"] = self.sliding_window is not None
        return cfg


def _load_presets() -> dict[str, ModelConfig]:
    data = json.loads(resources.files("iterserve").joinpath("data/model_presets.json").read_text("utf-8"))
    return {key: ModelConfig(**{k: v for k, v in entry.items() if k != "source"})
            for key, entry in data["presets"].items()}


# Real shapes of well-known checkpoints, package data with each entry's source (its config.json).
PRESETS: dict[str, ModelConfig] = _load_presets()


_NAME_SUFFIXES = ("-hf", "-instruct", "-chat", "-base", "-it", "-v0.1")


def _norm_model_name(name: str) -> str:
    key = name.strip().lower().rsplit("/", 1)[-1].replace("_", "-").replace(" ", "-")
    changed = True
    while changed:
        changed = False
        for suffix in _NAME_SUFFIXES:
            if key.endswith(suffix):
                key, changed = key[: -len(suffix)], True
    key = key.removeprefix("meta-")
    return re.sub(r"[^a-z0-9.]", "", key)


def find_preset(name: str) -> str | None:
    """The preset key for a preset name or a common spelling of it, or None.

    ``"Llama-2-7B"``, ``"meta-llama/Llama-2-7b-hf"``, ``"llama2-7b"`` and
    ``"Meta-Llama-3-8B-Instruct"`` all resolve; matching ignores case, an ``org/`` prefix, a
    ``meta-`` prefix, ``-hf``/``-instruct``/``-chat`` suffixes and punctuation.
    """
    if name.lower() in PRESETS:
        return name.lower()
    target = _norm_model_name(name)
    for key, cfg in PRESETS.items():
        if target in (_norm_model_name(key), _norm_model_name(cfg.name)):
            return key
    return None


def get_preset(name: str) -> ModelConfig:
    """A copy of the preset ``name`` (any spelling :func:`find_preset` takes)."""
    key = find_preset(name)
    if key is None:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[key].replace()


# -- engine, scheduler and server settings ------------------------------------------------------------

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Batching = Literal["continuous", "static"]
KVAllocation = Literal["paged", "reserved"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
LOG_LEVELS: tuple[str, ...] = typing.get_args(LogLevel)


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
                                            "batch starts only when the previous one has finished")
    kv_allocation: KVAllocation = _opt("paged", "paged: KV blocks as tokens arrive; reserved: blocks for "
                                                "prompt + max_tokens held from admission")
    max_model_len: int | None = _opt(None, "a sequence reaching this many tokens finishes with 'length'", cli=False)

    def __post_init__(self) -> None:
        _check_positive(self, "max_num_seqs", "max_num_batched_tokens")
        _check_positive(self, "max_model_len", allow_none=True)
        _check_choice(self, "batching", Batching)
        _check_choice(self, "kv_allocation", KVAllocation)


@dataclass(frozen=True)
class EngineConfig:
    """One engine: the model, its precision and device, the KV pool and the scheduler's limits."""

    model: str = _opt(DEFAULT_MODEL, "embedded model name, .gguf file, Hugging Face folder, or random:<preset>")
    dtype: Dtype = _opt("auto", "weights and KV cache precision; auto is bfloat16 where the hardware computes in "
                                "it, else float32")
    device: str | None = _opt(None, "cpu, cuda or cuda:N (default: cuda when available)")
    block_size: int = _opt(16, "tokens per KV cache block")
    max_model_len: int | None = _opt(None, "longest prompt + output (default: the model's context, capped by "
                                           "what the KV pool holds)")
    max_num_seqs: int = _same_as(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int = _same_as(SchedulerConfig, "max_num_batched_tokens")
    enable_prefix_caching: bool = _opt(True, "reuse the KV blocks of prompt prefixes seen before",
                                       flag="--prefix-caching")
    kv_cache_memory: str | int = _opt("2GiB", "KV pool size, e.g. 2GiB or 512MiB")
    num_kv_blocks: int | None = _opt(None, "KV pool size in blocks (overrides --kv-cache-memory)")
    batching: Batching = _same_as(SchedulerConfig, "batching")
    kv_allocation: KVAllocation = _same_as(SchedulerConfig, "kv_allocation")
    tensor_parallel_size: int = _opt(1, "split every layer over this many processes (tensor parallelism); "
                                        "under torchrun, the launcher's WORLD_SIZE")
    seed: int = _opt(0, "seed of random weights and of sampling without a per-request seed")
    step_trace: str | None = _opt(None, "write a JSON-lines trace of every step and request to this file")
    step_history: int = _opt(0, "keep the last N steps' StepStats in memory (benchmarks, tests)", cli=False)

    def __post_init__(self) -> None:
        # aliases (fp32, bf16, half) are accepted and stored under their one canonical name
        object.__setattr__(self, "dtype", _canonical_dtype(self.dtype))
        _check_positive(self, "block_size", "tensor_parallel_size")
        _check_positive(self, "max_model_len", "num_kv_blocks", allow_none=True)
        if not isinstance(self.step_history, int) or self.step_history < 0:
            raise ValueError(f"step_history must be an integer >= 0, got {self.step_history!r}")
        self.scheduler_config(self.max_model_len)  # the scheduler's fields are checked where they are defined

    def scheduler_config(self, max_model_len: int | None) -> SchedulerConfig:
        """The scheduler's share of this config, with max_model_len resolved against the KV pool."""
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.batching, self.kv_allocation,
                               max_model_len)


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
    log_level: LogLevel = _opt("INFO", "log level of the server and its engine core", cli=False)

    def __post_init__(self) -> None:
        _check_positive(self, "max_waiting", "max_request_body_bytes", "data_parallel_size")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout!r}")
        object.__setattr__(self, "log_level", str(self.log_level).upper())
        _check_choice(self, "log_level", LogLevel)

    def model_name(self, engine: EngineConfig) -> str:
        """The name clients ask for: ``served_model_name``, else the engine's model."""
        return self.served_model_name or engine.model


# -- command-line flags from fields -------------------------------------------------------------------


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, unless its help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "default:" in action.help:
            return action.help
        return super()._get_help_string(action)


def _flag_type(hint: Any) -> tuple[Any, tuple[str, ...] | None]:
    """argparse ``type`` and ``choices`` of a field's type hint (``int | None`` -> int)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is Literal:
        return str, tuple(typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if all(typing.get_origin(a) is Literal for a in args):
            return str, tuple(v for a in args for v in typing.get_args(a))
        return (args[0] if len(args) == 1 else str), None
    return hint, None


def add_config_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                    include: tuple[str, ...] | None = None) -> None:
    """One flag per field of the dataclass ``cls`` (``max_num_seqs`` -> ``--max-num-seqs``), with the
    field's default and help; booleans get ``--x/--no-x``. ``include`` picks a subset of fields."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli", True) is False or (include is not None and f.name not in include):
            continue
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        default = f.default
        if "env" in f.metadata:
            default = os.environ.get(f.metadata["env"], default)
        if hints[f.name] is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=f.metadata["help"])
            continue
        kind, choices = _flag_type(hints[f.name])
        parser.add_argument(flag, dest=f.name, type=kind, choices=choices, default=default, help=f.metadata["help"])


def config_from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """Build ``cls`` from the parsed flags that :func:`add_config_args` added (fields without a flag keep
    their defaults unless given in ``overrides``)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**{**given, **overrides})
