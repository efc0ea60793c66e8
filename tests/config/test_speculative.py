"""speculative_config as vLLM spells it: a dict, its JSON on the command line, checked when built."""

from __future__ import annotations

import dataclasses
import json

import pytest

from iterserve.cli.flags import config_from_args
from iterserve.cli.main import build_parser
from iterserve.config import EngineConfig, SpeculativeConfig
from iterserve.config.speculative import DEFAULT_DISABLE_BY_BATCH_SIZE


def test_vllm_dicts_parse_with_vllms_defaults():
    ngram = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (ngram.method, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == ("ngram", 3, 3)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).prompt_lookup_min == 5  # method defaults to ngram
    draft = SpeculativeConfig.parse('{"model": "random:smollm2-135m", "num_speculative_tokens": 2}')
    assert draft.method == "draft_model" and draft.uses_draft_model
    assert draft.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("null") is None


@pytest.mark.parametrize("bad, message", [
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"num_speculative_tokens": 2, "method": "eagle"}, "method must be"),
    ({"num_speculative_tokens": 2, "method": "draft_model"}, "needs 'model'"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
    ({"num_speculative_tokens": 2, "lookahead": 3}, "unknown key"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"model": "smollm2-135m", "num_speculative_tokens": 2, "quantization": "awq"}, "'gguf' or 'int8'"),
    ({"num_speculative_tokens": 2, "quantization": "gguf"}, "applies to a draft model"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a dict"),
])
def test_bad_configs_are_refused_with_the_reason(bad, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(bad)


def test_engine_config_takes_a_dict_json_or_its_own_dataclass_back():
    spec = {"model": "random:smollm2-135m?num_layers=1", "num_speculative_tokens": 3}
    config = EngineConfig(speculative_config=spec)
    assert isinstance(config.speculative_config, SpeculativeConfig)
    # a tensor-parallel worker gets the engine's config as JSON and rebuilds it
    again = EngineConfig(**json.loads(json.dumps(dataclasses.asdict(config))))
    assert again == config
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineConfig(speculative_config=spec, tensor_parallel_size=2)
    EngineConfig(speculative_config={"num_speculative_tokens": 3}, tensor_parallel_size=2)  # n-gram is fine


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_flag_takes_vllms_json(command):
    text = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    prompt = ["hi"] if command == "generate" else []
    args = build_parser().parse_args([command, "--speculative-config", text, *prompt])
    config = config_from_args(EngineConfig, args)
    assert config.speculative_config == SpeculativeConfig(4, "ngram", None, 2, 5)
