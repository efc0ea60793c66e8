"""Offline throughput: one workload through the engine under several batching modes, in-process.

Every request is queued at once with ``ignore_eos`` and ``max_tokens`` set to its output length,
so each mode does exactly the same useful work and differs only in how it packs that work into
forward passes. Continuous batching refills a finished sequence's slot at the next step; static
batching waits for the whole batch; ``reserved`` is continuous batching that holds KV blocks for
``prompt + max_tokens`` from admission, as servers did before paging. ``hf-static`` is the naive
baseline: transformers' ``generate`` over padded batches.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from iterserve.bench.metrics import DEFAULT_PERCENTILES, RequestResult, compute_metrics
from iterserve.bench.workloads import Request
from iterserve.engine.llm_engine import EngineConfig
from iterserve.llm import LLM
from iterserve.models.loader import LoadedModel, embedded_model_path
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams
from iterserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# mode -> (batching, kv_allocation)
ENGINE_MODES = {
    "continuous": ("continuous", "paged"),
    "static": ("static", "paged"),
    "reserved": ("continuous", "reserved"),
}
HF_MODE = "hf-static"


@dataclass
class ThroughputRun:
    """One mode's totals. ``latency`` holds vLLM-named TTFT/TPOT/ITL/E2EL statistics (ms), timed
    from when each request was queued: all at the start, so TTFT includes the wait for a slot."""

    mode: str
    num_requests: int
    elapsed_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    peak_running: int
    num_steps: int
    output_tokens_per_step: float
    num_preemptions: int
    latency: dict[str, float] | None = None
    step_trace: str | None = None


def token_prompts(requests: list[Request], tokenizer: Tokenizer | None) -> list[list[int]]:
    """Every prompt as the token ids the engine would run (chat messages through the chat template)."""
    out = []
    for r in requests:
        if isinstance(r.prompt, list) and all(isinstance(t, int) for t in r.prompt):
            out.append(list(r.prompt))
        elif tokenizer is None:
            raise ValueError("this workload has text prompts but the model has no tokenizer")
        elif isinstance(r.prompt, str):
            out.append(tokenizer.encode(r.prompt))
        else:
            out.append(tokenizer.apply_chat_template(r.prompt, tokenize=True))
    return out


def fit_to_context(
    requests: list[Request], prompts: list[list[int]], max_model_len: int
) -> tuple[list[Request], list[list[int]]]:
    """Drop requests whose prompt plus output would not fit the context, with a warning."""
    keep = [i for i, p in enumerate(prompts) if len(p) + requests[i].output_len <= max_model_len]
    if len(keep) < len(requests):
        logger.warning("skipping %d of %d requests longer than max_model_len=%d",
                       len(requests) - len(keep), len(requests), max_model_len)  # fmt: skip
    if not keep:
        raise ValueError(f"no request of the workload fits max_model_len={max_model_len}")
    return [dataclasses.replace(requests[i], prompt_len=len(prompts[i])) for i in keep], [prompts[i] for i in keep]


def _request_result(out: RequestOutput) -> RequestResult:
    m = out.metrics
    times = m.token_times
    return RequestResult(
        prompt_len=len(out.prompt_token_ids), output_len=len(out.outputs[0].token_ids),
        ttft=times[0] - m.arrival_time, itl=m.itl, latency=times[-1] - m.arrival_time, success=True,
    )


def _latency_summary(results: list[RequestResult], elapsed: float, percentiles: list[float]) -> dict[str, float]:
    summary = compute_metrics(results, elapsed, percentiles)
    return {k: v for k, v in summary.items() if k.endswith("_ms")}


def _engine_kwargs(config: EngineConfig, **overrides: Any) -> dict[str, Any]:
    kw = {**dataclasses.asdict(config), **overrides}
    kw.pop("model")
    return kw


def run_engine_mode(
    loaded: LoadedModel,
    config: EngineConfig,
    mode: str,
    requests: list[Request],
    prompts: list[list[int]],
    *,
    temperature: float = 0.0,
    step_trace: str | None = None,
    percentiles: list[float] | None = None,
    use_tqdm: bool = True,
) -> ThroughputRun:
    """Run the workload through a fresh engine in ``mode`` (continuous, static or reserved)."""
    batching, kv_allocation = ENGINE_MODES[mode]
    kwargs = _engine_kwargs(config, batching=batching, kv_allocation=kv_allocation, step_trace=step_trace)
    llm = LLM(loaded.name, loaded=loaded, **kwargs)
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=temperature, seed=config.seed + i)
              for i, r in enumerate(requests)]  # fmt: skip
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    engine = llm.engine
    engine.close()
    results = [_request_result(o) for o in outputs]
    n_in = sum(len(p) for p in prompts)
    n_out = sum(r.output_len for r in results)
    return ThroughputRun(
        mode=mode, num_requests=len(requests), elapsed_s=elapsed, total_input_tokens=n_in, total_output_tokens=n_out,
        request_throughput=len(requests) / elapsed, output_throughput=n_out / elapsed,
        total_token_throughput=(n_in + n_out) / elapsed, peak_running=engine.peak_running,
        num_steps=engine.num_steps, output_tokens_per_step=n_out / engine.num_steps,
        num_preemptions=engine.num_preemptions,
        latency=_latency_summary(results, elapsed, percentiles or list(DEFAULT_PERCENTILES)),
        step_trace=step_trace,
    )


def _load_hf_model(name: str, dtype: torch.dtype, device: torch.device):
    try:
        import transformers
    except ImportError:
        raise ValueError(
            "--hf-baseline runs transformers' generate, and transformers is not installed; "
            "install it with: pip install 'iterserve[test]'"
        ) from None
    try:
        path = embedded_model_path(name.lower())
    except KeyError:
        path = Path(name).expanduser()
    if path.is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    elif path.is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        raise ValueError(
            f"--hf-baseline needs a model transformers can load (embedded, .gguf or a folder), not {name!r}"
        )
    return model.to(device).eval()


def run_hf_static(
    loaded: LoadedModel, requests: list[Request], prompts: list[list[int]], batch_size: int,
    *, temperature: float = 0.0, use_tqdm: bool = True,
) -> ThroughputRun:
    """transformers' ``generate`` on left-padded batches of ``batch_size`` requests in arrival order.

    A batch runs until its longest output is done (``min_new_tokens`` keeps EOS from ending it
    early, as ``ignore_eos`` does in the engine), so shorter requests hold idle slots; each batch
    costs as many forward passes as its longest output, counted as steps.
    """
    from tqdm.auto import tqdm

    model = _load_hf_model(loaded.name, loaded.model.dtype, loaded.model.device)
    device = loaded.model.device
    pad = loaded.config.eos_token_id if isinstance(loaded.config.eos_token_id, int) else 0
    steps = 0
    start = time.perf_counter()
    with tqdm(total=len(requests), desc=HF_MODE, unit="req", disable=not use_tqdm) as bar, torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            batch = prompts[i:i + batch_size]
            max_new = max(r.output_len for r in requests[i:i + batch_size])
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
            sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                           pad_token_id=pad, **sampling)  # fmt: skip
            steps += max_new
            bar.update(len(batch))
    elapsed = time.perf_counter() - start
    n_in = sum(len(p) for p in prompts)
    n_out = sum(r.output_len for r in requests)
    return ThroughputRun(
        mode=HF_MODE, num_requests=len(requests), elapsed_s=elapsed, total_input_tokens=n_in,
        total_output_tokens=n_out, request_throughput=len(requests) / elapsed, output_throughput=n_out / elapsed,
        total_token_throughput=(n_in + n_out) / elapsed, peak_running=min(batch_size, len(requests)),
        num_steps=steps, output_tokens_per_step=n_out / steps, num_preemptions=0,
    )


def run_throughput(
    loaded: LoadedModel,
    config: EngineConfig,
    requests: list[Request],
    modes: list[str],
    *,
    temperature: float = 0.0,
    trace_dir: str | None = None,
    percentiles: list[float] | None = None,
    use_tqdm: bool = True,
) -> dict[str, Any]:
    """Run every mode on the same workload; returns the JSON-ready result.

    ``continuous_over_static`` is the ratio of output tokens/s, and
    ``continuous_over_static_per_step`` the ratio of output tokens per engine step (a ratio of
    counts, independent of how fast the machine is).
    """
    unknown = [m for m in modes if m not in ENGINE_MODES and m != HF_MODE]
    if unknown or not modes:
        raise ValueError(f"unknown mode(s) {', '.join(unknown) or '(none)'}; use {', '.join([*ENGINE_MODES, HF_MODE])}")
    prompts = token_prompts(requests, loaded.tokenizer)
    # A few short requests through an engine of the same configuration first, so one-time costs
    # do not land in the first mode timed; it also tells how long a sequence may be.
    probe = LLM(loaded.name, loaded=loaded, **_engine_kwargs(config, step_trace=None))
    vocab = loaded.config.vocab_size
    probe.generate([[(7 * i + 101) % vocab for i in range(n)] for n in (17, 40)],
                   SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))  # fmt: skip
    requests, prompts = fit_to_context(requests, prompts, probe.engine.max_model_len)
    del probe
    if trace_dir is not None:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
    runs = []
    for mode in modes:
        if mode == HF_MODE:
            runs.append(run_hf_static(loaded, requests, prompts, config.max_num_seqs,
                                      temperature=temperature, use_tqdm=use_tqdm))  # fmt: skip
        else:
            trace = str(Path(trace_dir) / f"{mode}.jsonl") if trace_dir is not None else None
            runs.append(run_engine_mode(loaded, config, mode, requests, prompts, temperature=temperature,
                                        step_trace=trace, percentiles=percentiles, use_tqdm=use_tqdm))  # fmt: skip
    by_mode = {r.mode: r for r in runs}
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "model": loaded.name,
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
        "device": str(loaded.model.device),
        "engine": _engine_kwargs(config, step_trace=None),
        "num_requests": len(requests),
        "runs": [dataclasses.asdict(r) for r in runs],
    }
    if "continuous" in by_mode and "static" in by_mode:
        c, s = by_mode["continuous"], by_mode["static"]
        result["continuous_over_static"] = c.output_throughput / s.output_throughput
        result["continuous_over_static_per_step"] = c.output_tokens_per_step / s.output_tokens_per_step
    return result
