"""An offline script written for vLLM, unchanged but for its imports (and a local model name).

It uses what vLLM scripts use: vLLM's constructor options, ``get_tokenizer`` and its chat
template, TextPrompt and TokensPrompt dicts, ``SamplingParams(n=...)``, ``Logprob`` objects and
prompt logprobs. It prints one JSON line per completion for the test that runs it to check.
"""

import json
import sys

from iterserve import LLM, SamplingParams  # in vLLM: from vllm import LLM, SamplingParams
from iterserve.inputs import TokensPrompt  # in vLLM: from vllm.inputs import TokensPrompt

MODEL = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"


def main() -> None:
    llm = LLM(model=MODEL, dtype="auto", gpu_memory_utilization=0.01, max_model_len=256, max_num_seqs=16,
              enforce_eager=True, trust_remote_code=True, tensor_parallel_size=1, seed=0)
    tokenizer = llm.get_tokenizer()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}], tokenize=False,
                                         add_generation_prompt=True)
    prompts = [
        {"prompt": "The capital of France is"},
        {"prompt": chat},
        TokensPrompt(prompt_token_ids=tokenizer.encode("Hello, my name is")),
    ]
    params = SamplingParams(n=2, temperature=0.8, top_p=0.95, max_tokens=12, logprobs=2, prompt_logprobs=1, seed=1)
    outputs = llm.generate(prompts, params)
    for output in outputs:
        assert output.prompt_logprobs[0] is None
        prompt_lps = [entry[token].logprob for token, entry in
                      zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:])]
        for completion in output.outputs:
            sampled = [entry[token] for token, entry in zip(completion.token_ids, completion.logprobs)]
            print(json.dumps({
                "request_id": output.request_id, "prompt": output.prompt, "index": completion.index,
                "text": completion.text, "num_tokens": len(completion.token_ids),
                "cumulative_logprob": completion.cumulative_logprob,
                "sampled": [[lp.logprob, lp.rank, lp.decoded_token] for lp in sampled],
                "alternatives": [len(entry) for entry in completion.logprobs],
                "num_prompt_tokens": len(output.prompt_token_ids), "prompt_logprobs": prompt_lps,
                "finish_reason": completion.finish_reason,
            }))


if __name__ == "__main__":
    main()
