"""A vLLM offline script using vLLM's further SamplingParams options and ``LLM.chat``'s arguments,
unchanged but for its imports (and a local model name). It asserts what vLLM documents for each."""

import sys

from iterserve import LLM, SamplingParams  # in vLLM: from vllm import LLM, SamplingParams
from iterserve.sampling_params import RequestOutputKind  # in vLLM: from vllm.sampling_params import ...

MODEL = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"


def main() -> None:
    llm = LLM(model=MODEL, max_model_len=256, seed=0)
    tokenizer = llm.get_tokenizer()
    defaults = llm.get_default_sampling_params()
    defaults.max_tokens, defaults.temperature = 16, 0
    prompt = "The capital of France is"
    plain = llm.generate(prompt, defaults, use_tqdm=False)[0].outputs[0]
    print("plain:", repr(plain.text))

    # the stop string stays in the text; the first word of the greedy answer becomes the stop string
    word = plain.text.split()[0]
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop=[word],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text.endswith(word) and kept.stop_reason == word, kept

    # a bad word never appears, and the greedy text changes where it would have
    banned = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, bad_words=[word]),
                          use_tqdm=False)[0].outputs[0]
    assert word not in banned.text.split() and banned.text != plain.text, banned

    # only the allowed tokens are sampled
    allowed = tokenizer.encode(" yes no maybe", add_special_tokens=False)
    limited = llm.generate(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=8, allowed_token_ids=allowed),
                           use_tqdm=False)[0].outputs[0]
    assert set(limited.token_ids) <= set(allowed), limited

    # token ids without text
    ids_only = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, detokenize=False),
                            use_tqdm=False)[0].outputs[0]
    assert ids_only.text == "" and ids_only.token_ids == plain.token_ids

    # output_kind is the engine's way to stream: DELTA outputs add up to the whole text
    engine = llm.llm_engine
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=16, output_kind=RequestOutputKind.DELTA,
                                              extra_args={"plugin": "ignored"}))
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [o.outputs[0].text for o in engine.step()]
    assert len(pieces) > 1 and "".join(pieces) == plain.text, pieces

    # chat: the rendered prompt comes back; tools, templates and their variables are passed through
    messages = [{"role": "user", "content": "Name a colour."}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert out.prompt == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == tokenizer.encode(out.prompt, add_special_tokens=False)
    template = ("{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
                "{% for m in messages %}{{ greeting }} {{ m['content'] }}\n{% endfor %}Answer:")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    custom = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False, chat_template=template,
                      chat_template_kwargs={"greeting": "Hi!"}, tools=[tool])[0]
    assert custom.prompt == "[get_weather]Hi! Name a colour.\nAnswer:", custom.prompt
    partial = [*messages, {"role": "assistant", "content": "My favourite colour is"}]
    cont = llm.chat(partial, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                    add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("My favourite colour is"), cont.prompt
    print("ok")


if __name__ == "__main__":
    main()
