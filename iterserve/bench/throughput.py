"""Offline throughput: one workload through the engine under several batching modes, in-process.

Every request is queued at once with ``ignore_eos``, so each mode does exactly the same useful work
and differs only in how it packs that work into forward passes. Continuous batching refills a
finished sequence's slot at the next step; static batching waits for the whole batch; ``reserved``
is continuous batching that holds KV blocks for ``prompt + max_tokens`` from admission, as servers
did before paging. ``no-spec`` is continuous batching with speculative decoding turned off, the
baseline of an engine configured with ``--speculative-config``. ``hf-static`` is the naive
baseline: transformers' ``generate`` over padded batches.

A request's ``max_tokens`` is its drawn output length unless a cap is given: then it asks for the
cap (as a client asking for 512 tokens does) and the driver ends it once it has produced its drawn
length (an emulated end-of-sequence, through :meth:`LLMEngine.abort_request`), so ``reserved``
holds blocks for the cap while paged allocation holds only what is written.

Counts lead the report because they do not depend on the machine's speed: engine steps, output
tokens per step, running sequences, slot occupancy and KV blocks held, all read from the engine's
JSON-lines step trace. Wall-clock figures follow, over ``repeats`` runs of every mode (interleaved,
so a busy spell does not land on one mode only), with a busy-machine check around them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from iterserve.bench.machine import MachineMonitor
from iterserve.bench.metrics import DEFAULT_PERCENTILES, RequestResult, compute_metrics
from iterserve.bench.step_counts import StepCounts, trace_counts
from iterserve.bench.workloads import Request, is_token_ids
from iterserve.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.models.loader import LoadedModel
from iterserve.models.sources import GGUFFile, HFFolder, resolve_model
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams
from iterserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# mode -> (batching, kv_allocation)
ENGINE_MODES = {
    "continuous": ("continuous", "paged"),
    "static": ("static", "paged"),
    "dynamic": ("dynamic", "paged"),
    "reserved": ("continuous", "reserved"),
    "no-spec": ("continuous", "paged"),  # and no speculative decoding
}
HF_MODE = "hf-static"


@dataclass
class Timed:
    """One repeat's wall-clock figures."""

    elapsed_s: float
    latency: dict[str, float] | None = None


@dataclass
class ThroughputRun:
    """One mode's totals: counts first, then wall-clock medians over the repeats and every repeat's
    value (``*_runs``). ``latency`` holds vLLM-named TTFT/TPOT/ITL/E2EL statistics (ms), each the
    median over repeats, timed from when each request was queued: all at the start, so TTFT
    includes the wait for a slot."""

    mode: str
    num_requests: int
    total_input_tokens: int
    total_output_tokens: int
    num_steps: int
    output_tokens_per_step: float
    peak_running: int
    mean_running: float
    slot_occupancy: float
    peak_kv_blocks: int | None
    mean_kv_blocks: float | None
    num_preemptions: int
    joined_running_batch: int | None
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float | None
    mean_accepted_length: float | None
    repeats: int
    elapsed_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    elapsed_s_runs: list[float] = field(default_factory=list)
    output_throughput_runs: list[float] = field(default_factory=list)
    latency: dict[str, float] | None = None
    latency_runs: list[dict[str, float]] | None = None
    step_trace: str | None = None


def _make_run(mode: str, n_req: int, n_in: int, n_out: int, counts: StepCounts, timed: list[Timed],
              step_trace: str | None) -> ThroughputRun:
    elapsed = [t.elapsed_s for t in timed]
    median = statistics.median(elapsed)
    latencies = [t.latency for t in timed if t.latency is not None]
    latency = ({k: statistics.median(run[k] for run in latencies) for k in latencies[0]} if latencies else None)
    return ThroughputRun(
        mode=mode, num_requests=n_req, total_input_tokens=n_in, total_output_tokens=n_out,
        **dataclasses.asdict(counts), acceptance_rate=counts.acceptance_rate,
        mean_accepted_length=counts.mean_accepted_length, repeats=len(timed), elapsed_s=median,
        request_throughput=n_req / median,
        output_throughput=n_out / median, total_token_throughput=(n_in + n_out) / median, elapsed_s_runs=elapsed,
        output_throughput_runs=[n_out / e for e in elapsed], latency=latency, latency_runs=latencies or None,
        step_trace=step_trace,
    )


def token_prompts(requests: list[Request], tokenizer: Tokenizer | None) -> list[list[int]]:
    """Every prompt as the token ids the engine would run (chat messages through the chat template)."""
    out: list[list[int]] = []
    for r in requests:
        if is_token_ids(r.prompt):
            out.append(list(r.prompt))
        elif tokenizer is None:
            raise ValueError("this workload has text prompts but the model has no tokenizer")
        elif isinstance(r.prompt, str):
            out.append(tokenizer.encode(r.prompt))
        else:
            out.append(tokenizer.apply_chat_template(r.prompt, tokenize=True))
    return out


def fit_to_context(
    requests: list[Request], prompts: list[list[int]], max_model_len: int, max_tokens_cap: int | None = None
) -> tuple[list[Request], list[list[int]]]:
    """Drop requests whose prompt plus ``max_tokens`` would not fit the context, with a warning."""
    keep = [i for i, p in enumerate(prompts) if len(p) + max_tokens(requests[i], max_tokens_cap) <= max_model_len]
    if len(keep) < len(requests):
        logger.warning("skipping %d of %d requests longer than max_model_len=%d",
                       len(requests) - len(keep), len(requests), max_model_len)
    if not keep:
        raise ValueError(f"no request of the workload fits max_model_len={max_model_len}")
    return [dataclasses.replace(requests[i], prompt_len=len(prompts[i])) for i in keep], [prompts[i] for i in keep]


def max_tokens(request: Request, cap: int | None) -> int:
    """What a request asks the engine for: the cap when one is given (never less than its drawn length)."""
    return request.output_len if cap is None else max(cap, request.output_len)


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


def _engine_config(config: EngineConfig, **overrides: Any) -> EngineConfig:
    return dataclasses.replace(config, **overrides)


def drive(
    engine: LLMEngine, requests: list[Request], prompts: list[list[int]], params: list[SamplingParams],
    *, arrivals: list[float] | None = None, use_tqdm: bool = True, desc: str = "generate",
) -> list[RequestOutput]:
    """Queue every request at its arrival (seconds from the start; default: all at once) and step the
    engine until all are done, ending each request once it has produced its drawn ``output_len`` (an
    emulated end-of-sequence when ``max_tokens`` is larger). A request arrives into the queue at its
    time even while a step runs; the engine sees it before its next step, so its TTFT counts that wait.

    Returns each request's last output, in workload order.
    """
    from tqdm.auto import tqdm

    offsets = arrivals if arrivals is not None else [0.0] * len(requests)
    order = sorted(range(len(requests)), key=offsets.__getitem__)
    target = {str(i): r.output_len for i, r in enumerate(requests)}
    final: dict[str, RequestOutput] = {}
    start, sent = time.perf_counter(), 0
    with tqdm(total=len(requests), desc=desc, disable=not use_tqdm, unit="req") as bar:
        while sent < len(order) or engine.has_unfinished_requests():
            now = time.perf_counter()
            while sent < len(order) and start + offsets[order[sent]] <= now:
                i = order[sent]
                engine.add_request(prompts[i], params[i], request_id=str(i), arrival_time=start + offsets[i])
                sent += 1
            hold = engine.core.scheduler.hold_s() if engine.has_unfinished_requests() else math.inf
            if hold > 0:  # idle, or a dynamic batch filling: sleep until it starts or the next request comes
                upcoming = start + offsets[order[sent]] - now if sent < len(order) else math.inf
                time.sleep(min(hold, upcoming))
                continue
            for out in engine.step():
                if out.finished or len(out.outputs[0].token_ids) >= target[out.request_id]:
                    if not out.finished:
                        engine.abort_request(out.request_id)
                    final[out.request_id] = out
                    bar.update(1)
    return [final[str(i)] for i in range(len(requests))]


def run_engine_mode(
    loaded: LoadedModel,
    config: EngineConfig,
    mode: str,
    requests: list[Request],
    prompts: list[list[int]],
    *,
    temperature: float = 0.0,
    step_trace: str,
    max_tokens_cap: int | None = None,
    percentiles: list[float] | None = None,
    arrivals: list[float] | None = None,
    use_tqdm: bool = True,
) -> tuple[StepCounts, Timed, int]:
    """Run the workload once through a fresh engine in ``mode`` (continuous, static, dynamic or reserved),
    writing its step trace to ``step_trace``; returns the counts, the timing and the output tokens.
    ``arrivals`` are the requests' arrival times in seconds from the start (default: all at once)."""
    batching, kv_allocation = ENGINE_MODES[mode]
    cfg = _engine_config(config, batching=batching, kv_allocation=kv_allocation, step_trace=step_trace,
                         **({"speculative_config": None} if mode == "no-spec" else {}))
    engine = LLMEngine(cfg, loaded)
    params = [SamplingParams(max_tokens=max_tokens(r, max_tokens_cap), ignore_eos=True, temperature=temperature,
                             seed=config.seed + i) for i, r in enumerate(requests)]
    start = time.perf_counter()
    try:
        outputs = drive(engine, requests, prompts, params, arrivals=arrivals, use_tqdm=use_tqdm, desc=mode)
    finally:
        engine.close()
    elapsed = time.perf_counter() - start
    results = [_request_result(o) for o in outputs]
    n_out = sum(r.output_len for r in results)
    counts = trace_counts(step_trace, config.max_num_seqs, n_out)
    return counts, Timed(elapsed, _latency_summary(results, elapsed, percentiles or list(DEFAULT_PERCENTILES))), n_out


def _load_hf_model(name: str, dtype: torch.dtype, device: torch.device) -> Any:
    """transformers' model for ``name`` (its class depends on the checkpoint, hence Any)."""
    source = resolve_model(name)
    model: Any
    if isinstance(source, GGUFFile):
        model = transformers.AutoModelForCausalLM.from_pretrained(source.path.parent, gguf_file=source.path.name,
                                                                  dtype=dtype)
    elif isinstance(source, HFFolder):
        model = transformers.AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
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
    costs as many forward passes as its longest output, counted as steps. Running sequences are
    counted as the engine counts them: a sequence whose output is done no longer runs, though
    its padded row is still computed.
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
                           pad_token_id=pad, **sampling)
            steps += max_new
            bar.update(len(batch))
    elapsed = time.perf_counter() - start
    n_in = sum(len(p) for p in prompts)
    n_out = sum(r.output_len for r in requests)
    mean_running = n_out / steps  # each running sequence yields one token per step
    counts = StepCounts(
        num_steps=steps, output_tokens_per_step=n_out / steps, peak_running=min(batch_size, len(requests)),
        mean_running=mean_running, slot_occupancy=mean_running / batch_size, peak_kv_blocks=None,
        mean_kv_blocks=None, num_preemptions=0, joined_running_batch=0,
    )
    return _make_run(HF_MODE, len(requests), n_in, n_out, counts, [Timed(elapsed)], None)


def run_throughput(
    loaded: LoadedModel,
    config: EngineConfig,
    requests: list[Request],
    modes: list[str],
    *,
    temperature: float = 0.0,
    trace_dir: str | None = None,
    max_tokens_cap: int | None = None,
    repeats: int = 1,
    percentiles: list[float] | None = None,
    monitor: MachineMonitor | None = None,
    use_tqdm: bool = True,
) -> dict[str, Any]:
    """Run every mode ``repeats`` times on the same workload; returns the JSON-ready result.

    Counts come from each mode's first run (they repeat exactly: every request has its own seed
    and ignores EOS); wall-clock figures are medians with every run's value kept. ``machine``
    holds the busy-machine check, sampled before the first run and after every round of modes.
    ``continuous_over_static`` is the ratio of median output tokens/s, and
    ``continuous_over_static_per_step`` the ratio of output tokens per engine step (a ratio of
    counts, independent of how fast the machine is).
    """
    unknown = [m for m in modes if m not in ENGINE_MODES and m != HF_MODE]
    if unknown or not modes:
        raise ValueError(f"unknown mode(s) {', '.join(unknown) or '(none)'}; use {', '.join([*ENGINE_MODES, HF_MODE])}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if max_tokens_cap is not None and max_tokens_cap < 1:
        raise ValueError(f"max_tokens cap must be >= 1, got {max_tokens_cap}")
    requests, prompts = warm_up(loaded, config, requests, max_tokens_cap)
    monitor = monitor or MachineMonitor()
    with tempfile.TemporaryDirectory() as tmp:
        traces = Path(trace_dir if trace_dir is not None else tmp)
        traces.mkdir(parents=True, exist_ok=True)
        first: dict[str, ThroughputRun] = {}
        counts: dict[str, tuple[StepCounts, int]] = {}
        timed: dict[str, list[Timed]] = {m: [] for m in modes}
        monitor.sample()
        for rep in range(repeats):
            for mode in modes:
                if mode == HF_MODE:
                    run = run_hf_static(loaded, requests, prompts, config.max_num_seqs, temperature=temperature,
                                        use_tqdm=use_tqdm)
                    first.setdefault(mode, run)
                    timed[mode].append(Timed(run.elapsed_s))
                    continue
                trace = traces / (f"{mode}.jsonl" if rep == 0 else f"{mode}.{rep}.jsonl")
                c, t, n_out = run_engine_mode(loaded, config, mode, requests, prompts, temperature=temperature,
                                              step_trace=str(trace), max_tokens_cap=max_tokens_cap,
                                              percentiles=percentiles, use_tqdm=use_tqdm)
                counts.setdefault(mode, (c, n_out))
                timed[mode].append(t)
            monitor.sample()
    n_in = sum(len(p) for p in prompts)
    runs = []
    for mode in modes:
        if mode == HF_MODE:
            base = first[mode]
            hf_counts = StepCounts(**{f.name: getattr(base, f.name) for f in dataclasses.fields(StepCounts)})
            runs.append(_make_run(mode, len(requests), n_in, base.total_output_tokens, hf_counts, timed[mode], None))
        else:
            c, n_out = counts[mode]
            trace_file = str(Path(trace_dir) / f"{mode}.jsonl") if trace_dir is not None else None
            runs.append(_make_run(mode, len(requests), n_in, n_out, c, timed[mode], trace_file))
    return _result(loaded, config, requests, max_tokens_cap, repeats, monitor, runs)


def warm_up(loaded: LoadedModel, config: EngineConfig, requests: list[Request],
             max_tokens_cap: int | None) -> tuple[list[Request], list[list[int]]]:
    """A few short requests through an engine of the same configuration, so one-time costs do not land in
    the first mode timed; it also tells how long a sequence may be. The requests that fit, as token ids."""
    prompts = token_prompts(requests, loaded.tokenizer)
    warm = LLMEngine(_engine_config(config, step_trace=None), loaded)
    vocab = loaded.config.vocab_size
    warm_prompts = [[(7 * i + 101) % vocab for i in range(n)] for n in (17, 40)]
    drive(warm, [Request(p, len(p), 4) for p in warm_prompts], warm_prompts,
          [SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)] * 2, use_tqdm=False)
    return fit_to_context(requests, prompts, warm.max_model_len, max_tokens_cap)


def _result(loaded: LoadedModel, config: EngineConfig, requests: list[Request], max_tokens_cap: int | None,
            repeats: int, monitor: MachineMonitor, runs: list[ThroughputRun]) -> dict[str, Any]:
    by_mode = {r.mode: r for r in runs}
    check = monitor.check
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "model": loaded.name,
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
        "device": str(loaded.model.device),
        "engine": dataclasses.asdict(_engine_config(config, step_trace=None)),
        "num_requests": len(requests),
        "max_tokens_cap": max_tokens_cap,
        "repeats": repeats,
        "machine": check.to_dict(),
        "busy_warning": check.warning(),
        "runs": [dataclasses.asdict(r) for r in runs],
    }
    if "continuous" in by_mode and "static" in by_mode:
        cont, stat = by_mode["continuous"], by_mode["static"]
        result["continuous_over_static"] = cont.output_throughput / stat.output_throughput
        result["continuous_over_static_runs"] = [a / b for a, b in zip(cont.output_throughput_runs,
                                                                        stat.output_throughput_runs)]
        result["continuous_over_static_per_step"] = cont.output_tokens_per_step / stat.output_tokens_per_step
    if "continuous" in by_mode and "no-spec" in by_mode:
        spec, plain = by_mode["continuous"], by_mode["no-spec"]
        result["spec_over_no_spec"] = spec.output_throughput / plain.output_throughput
        result["spec_over_no_spec_runs"] = [a / b for a, b in zip(spec.output_throughput_runs,
                                                                   plain.output_throughput_runs)]
    return result
