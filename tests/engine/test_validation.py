"""The checks of a tokenized request (iterserve/engine/validation.py)."""

from __future__ import annotations

import pytest

from iterserve.engine.validation import check_prompt
from iterserve.errors import SamplingParamsError
from iterserve.sampling_params import SamplingParams


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_beyond_max_logprobs_are_refused_naming_the_field_and_limit(field):
    params = SamplingParams(max_tokens=4, **{field: 6})
    with pytest.raises(SamplingParamsError, match=r"of 6, which is greater than max allowed: 5") as e:
        check_prompt([1, 2, 3], params, vocab_size=100, max_model_len=64, max_logprobs=5)
    assert e.value.param == field
    assert check_prompt([1, 2, 3], params, vocab_size=100, max_model_len=64, max_logprobs=6) == 4
    assert check_prompt([1, 2, 3], SamplingParams(max_tokens=4), vocab_size=100, max_model_len=64,
                        max_logprobs=0) == 4
