"""The output side on the real tokenizer: deltas add up to the text, stop strings cut the text and
ask for an abort, final-only outputs come once, and a slow consumer's backlog merges."""

from __future__ import annotations

import pytest

from iterserve.engine.messages import EngineCoreOutput
from iterserve.engine.output_processor import OutputProcessor, RequestOutputKind
from iterserve.models.loader import load_model_info
from iterserve.sampling_params import SamplingParams

TEXT = "The capital of France is Paris, a city of light."


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_info("smollm2-135m")[1]


def feed(op: OutputProcessor, rid: str, ids: list[int], finish: str | None = "length", logprobs: bool = False):
    """One core output per token, the last one finishing; returns what the processor made of each."""
    results = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        o = EngineCoreOutput(rid, [t], float(i + 1), new_logprobs=[{t: (-0.5, 1)}] if logprobs else None,
                             finish_reason=finish if last else None, first_scheduled_time=0.5 if i == 0 else None)
        results.append(op.process_outputs([o]))
    return results


def test_deltas_carry_only_new_tokens_and_add_up_to_the_text(tokenizer):
    op = OutputProcessor(tokenizer)
    ids = tokenizer.encode(TEXT)
    op.add_request("r", None, [1, 2], SamplingParams(logprobs=0), 0.0, RequestOutputKind.DELTA)
    outs = [out for r in feed(op, "r", ids, logprobs=True) for out in r.outputs]
    assert all(len(o.outputs[0].token_ids) == 1 and len(o.outputs[0].logprobs) == 1 for o in outs)
    assert "".join(o.outputs[0].text for o in outs) == tokenizer.decode(ids)
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length" and "r" not in op
    m = final.metrics
    assert m.num_output_tokens == len(ids) and m.first_scheduled_time == 0.5 and m.ttft == 1.0
    assert len(m.itl) == len(ids) - 1 and m.finished_time == len(ids)


def test_stop_string_truncates_never_streams_past_it_and_asks_for_an_abort(tokenizer):
    op = OutputProcessor(tokenizer)
    ids = tokenizer.encode(TEXT)
    op.add_request("r", None, [1], SamplingParams(stop=["Paris"]), 0.0, RequestOutputKind.DELTA)
    results = feed(op, "r", ids + ids)  # the core would have run on; the rest is ignored
    aborts = [rid for r in results for rid in r.to_abort]
    outs = [o for r in results for o in r.outputs]
    assert aborts == ["r"] and outs[-1].finished
    assert "".join(o.outputs[0].text for o in outs) == TEXT[: TEXT.index("Paris")]
    assert (outs[-1].outputs[0].finish_reason, outs[-1].outputs[0].stop_reason) == ("stop", "Paris")


def test_a_stop_token_adds_no_text(tokenizer):
    op = OutputProcessor(tokenizer)
    ids = tokenizer.encode("Hello world")
    eos = next(iter(tokenizer.eos_token_ids))
    op.add_request("r", None, [1], SamplingParams(), 0.0, RequestOutputKind.FINAL_ONLY)
    results = feed(op, "r", ids + [eos], finish="stop")
    outs = [o for r in results for o in r.outputs]
    assert len(outs) == 1 and outs[0].outputs[0].text == "Hello world"  # final-only: one output, at the end
    assert outs[0].outputs[0].token_ids == ids + [eos]


def test_merged_deltas_equal_the_cumulative_output(tokenizer):
    op = OutputProcessor(tokenizer)
    ids = tokenizer.encode(TEXT)
    op.add_request("d", None, [1], SamplingParams(logprobs=0), 0.0, RequestOutputKind.DELTA)
    op.add_request("c", None, [1], SamplingParams(logprobs=0), 0.0, RequestOutputKind.CUMULATIVE)
    pending = None
    cumulative = None
    for r in feed(op, "d", ids, logprobs=True):
        for o in r.outputs:
            if pending is None:
                pending = o
            else:
                pending.add(o)
    for r in feed(op, "c", ids, logprobs=True):
        cumulative = r.outputs[-1]
    merged, full = pending.outputs[0], cumulative.outputs[0]
    assert pending.finished and (merged.text, merged.token_ids, merged.logprobs) == (full.text, full.token_ids,
                                                                                    full.logprobs)
