"""The asyncio engine: concurrent generate() calls batched by one core process, the three output kinds,
aborts from the caller or from another task, bad input raised at once."""

from __future__ import annotations

import asyncio

import pytest

from iterserve import LLM, SamplingParams
from iterserve.engine.async_llm import AsyncLLM
from iterserve.errors import RequestError
from iterserve.sampling_params import RequestOutputKind

MODEL = "random:smollm2-135m?num_layers=2"
OPTIONS = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256, "seed": 0}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    llm = LLM(MODEL, **OPTIONS)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def greedy(kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


def test_generate_runs_concurrent_requests_in_every_output_kind(expected):
    async def collect(llm: AsyncLLM, prompt: list[int], kind: RequestOutputKind, rid: str) -> list[list[int]]:
        seen = []
        async for out in llm.generate({"prompt_token_ids": prompt}, greedy(kind), request_id=rid):
            seen.append(list(out.outputs[0].token_ids))
        return seen

    async def run() -> None:
        async with AsyncLLM.from_engine_args(MODEL, **OPTIONS) as llm:
            kinds = [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY]
            cumulative, delta, final = await asyncio.gather(
                *(collect(llm, p, k, f"r{i}") for i, (p, k) in enumerate(zip(PROMPTS, kinds))))
            assert cumulative[-1] == expected[0] and all(
                a == b[:len(a)] for a, b in zip(cumulative, cumulative[1:]))  # each output extends the last
            assert [t for d in delta for t in d] == expected[1] and len(delta) > 1
            assert final == [expected[2]]
            assert llm.engine_core.num_requests == 0

    asyncio.run(run())


def test_abort_from_another_task_and_leaving_the_loop_both_end_the_request():
    async def run() -> None:
        async with AsyncLLM.from_engine_args(MODEL, **OPTIONS) as llm:
            got: list[int] = []

            async def consume() -> None:
                async for out in llm.generate(PROMPTS[0], greedy(max_tokens=200), request_id="long"):
                    got.append(len(out.outputs[0].token_ids))

            task = asyncio.ensure_future(consume())
            while not got:
                await asyncio.sleep(0.01)
            await llm.abort("long")
            await asyncio.wait_for(task, 30)  # the loop ends instead of waiting forever
            assert got[-1] < 200

            async for _ in llm.generate(PROMPTS[1], greedy(max_tokens=200)):
                break  # leaving early aborts it
            for _ in range(100):
                if llm.engine_core.num_requests == 0:
                    break
                await asyncio.sleep(0.01)
            assert llm.engine_core.num_requests == 0

            with pytest.raises(RequestError, match="prompt token ids"):
                async for _ in llm.generate([10**7], greedy()):
                    pass
            await llm.check_health()

    asyncio.run(run())
