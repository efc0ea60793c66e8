"""Workloads: seeded and bounded synthetic requests, and dataset loaders that name the bad line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from iterserve.bench.workloads import (
    FIRST_RANDOM_TOKEN_ID,
    LengthDist,
    Request,
    WorkloadSpec,
    load_jsonl,
    load_sharegpt,
    make_workload,
    sample_requests,
)
from iterserve.models.loader import load_tokenizer

VOCAB = 1000


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


def test_same_seed_same_workload_other_seed_other_workload(tokenizer):
    for dataset in ("random", "text"):
        spec = WorkloadSpec(dataset=dataset, num_prompts=8, input_len="uniform:8:64", output_len="lognormal:16:1:64")
        a = make_workload(spec, tokenizer=tokenizer, vocab_size=VOCAB)
        assert a == make_workload(spec, tokenizer=tokenizer, vocab_size=VOCAB)
        other = WorkloadSpec(**{**spec.__dict__, "seed": 1})
        assert a != make_workload(other, tokenizer=tokenizer, vocab_size=VOCAB)


@pytest.mark.parametrize(
    "spec, low, high",
    [("fixed:7", 7, 7), ("uniform:32:256", 32, 256), ("normal:100:50:180", 1, 180),
     ("lognormal:64:1:384", 1, 384), ("pareto:16:1.1:384", 16, 384)],
)
def test_length_distributions_stay_in_bounds(spec, low, high):
    d = LengthDist.parse(spec)
    x = np.array(d.sample(np.random.default_rng(0), 5000))
    assert (d.low, d.high) == (low, high)
    assert x.min() >= low and x.max() <= high
    assert str(d) == spec


def test_heavy_tails_reach_the_cap_and_uniform_its_ends():
    rng = np.random.default_rng(0)
    lognormal = np.array(LengthDist.parse("lognormal:64:1:384").sample(rng, 5000))
    assert np.median(lognormal) == pytest.approx(64, rel=0.1)
    assert (lognormal == 384).mean() > 0.01  # the tail is clipped, not dropped
    uniform = LengthDist.parse("uniform:3:6").sample(rng, 1000)
    assert set(uniform) == {3, 4, 5, 6}


@pytest.mark.parametrize("bad", ["zipf:3", "uniform:5", "uniform:9:3", "lognormal:64:1", "normal:a:b:c", "fixed:0"])
def test_bad_length_distributions(bad):
    with pytest.raises(ValueError, match="length distribution"):
        LengthDist.parse(bad)


def test_random_prompts_avoid_special_ids_and_have_their_lengths():
    spec = WorkloadSpec(num_prompts=50, input_len="uniform:5:40", output_len="fixed:3")
    reqs = make_workload(spec, tokenizer=None, vocab_size=VOCAB)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len and r.output_len == 3 for r in reqs)
    ids = np.concatenate([r.prompt for r in reqs])
    assert ids.min() >= FIRST_RANDOM_TOKEN_ID and ids.max() < VOCAB
    assert 5 <= min(r.prompt_len for r in reqs) and max(r.prompt_len for r in reqs) <= 40


def test_text_prompts_are_corpus_text_of_about_the_target_length(tokenizer):
    spec = WorkloadSpec(dataset="text", num_prompts=10, input_len="fixed:48", output_len="fixed:8")
    for r in make_workload(spec, tokenizer=tokenizer):
        assert isinstance(r.prompt, str) and abs(r.prompt_len - 48) <= 3
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
        assert sum(c.isalpha() for c in r.prompt) > len(r.prompt) / 2
    with pytest.raises(ValueError, match="need a tokenizer"):
        make_workload(spec, tokenizer=None)


def test_shared_prefix_workload():
    spec = WorkloadSpec(num_prompts=6, input_len="uniform:4:12", output_len="fixed:2", shared_prefix_len=64)
    reqs = make_workload(spec, tokenizer=None, vocab_size=VOCAB)
    prefix = reqs[0].prompt[:64]
    assert all(r.prompt[:64] == prefix and 68 <= r.prompt_len <= 76 for r in reqs)
    assert len({tuple(r.prompt[64:]) for r in reqs}) == 6


# -- datasets -------------------------------------------------------------------------------------


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_prompts_messages_and_lengths(tmp_path, tokenizer):
    path = write_lines(tmp_path / "d.jsonl", [
        json.dumps({"prompt": "Hello there, how are you?", "output_len": 12}),
        "",
        json.dumps({"prompt": [101, 102, 103], "max_tokens": 5}),
        json.dumps({"messages": [{"role": "user", "content": "Name a colour."}]}),
    ])
    reqs = load_jsonl(path, tokenizer, default_output_len=99)
    assert [r.output_len for r in reqs] == [12, 5, 99]
    assert reqs[0].prompt_len == len(tokenizer.encode("Hello there, how are you?", add_special_tokens=False))
    assert reqs[1] == Request([101, 102, 103], 3, 5)
    assert reqs[2].prompt_len == len(tokenizer.apply_chat_template(reqs[2].prompt, tokenize=True))


@pytest.mark.parametrize(
    "bad_line, message",
    [("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object"),
     ('{"text": "hi"}', "a record needs 'prompt' or 'messages'"), ('{"prompt": ""}', "'prompt' must be"),
     ('{"prompt": "hi", "output_len": 0}', "output_len/max_tokens must be a positive integer"),
     ('{"prompt": "hi", "max_tokens": "ten"}', "output_len/max_tokens must be a positive integer"),
     ('{"messages": [{"role": "user"}]}', "'messages' must be")],
)
def test_jsonl_errors_name_the_file_and_line(tmp_path, tokenizer, bad_line, message):
    path = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "ok"}', "", bad_line])
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: {message}"):
        load_jsonl(path, tokenizer)


def test_jsonl_text_needs_a_tokenizer_and_empty_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"d\.jsonl:1: text prompts need a tokenizer"):
        load_jsonl(write_lines(tmp_path / "d.jsonl", ['{"prompt": "hi"}']), None)
    with pytest.raises(ValueError, match="no requests"):
        load_jsonl(write_lines(tmp_path / "e.jsonl", [""]), None)


def sharegpt_entry(*turns):
    return {"conversations": [{"from": f, "value": v} for f, v in turns]}


def test_sharegpt_uses_the_human_prompt_and_the_gpt_reply_length(tmp_path, tokenizer):
    path = tmp_path / "sg.json"
    reply = "Paris is the capital of France."
    path.write_text(json.dumps([
        sharegpt_entry(("human", "What is the capital of France?"), ("gpt", reply)),
        sharegpt_entry(("gpt", "orphan reply")),  # no human turn before it: skipped
        sharegpt_entry(("system", "be brief"), ("human", "Say hi."), ("gpt", "Hi!"), ("human", "again")),
    ]))
    reqs = load_sharegpt(path, tokenizer)
    assert [r.prompt for r in reqs] == ["What is the capital of France?", "Say hi."]
    assert reqs[0].output_len == len(tokenizer.encode(reply, add_special_tokens=False))


@pytest.mark.parametrize(
    "data, message",
    [({"conversations": []}, "expected a JSON list"),
     ([sharegpt_entry(("human", "a"), ("gpt", "b")), {"turns": []}],
      r"entry 1: expected an object with a 'conversations'"),
     ([{"conversations": [{"from": "human", "value": 3}]}], r"entry 0, turn 0"),
     ([sharegpt_entry(("gpt", "x"))], "no conversation has a human turn")],
)
def test_sharegpt_errors_name_the_entry(tmp_path, tokenizer, data, message):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"sg\.json.*{message}"):
        load_sharegpt(path, tokenizer)
    path.write_text("[{")
    with pytest.raises(ValueError, match=r"sg\.json: not valid JSON"):
        load_sharegpt(path, tokenizer)


def test_sampling_a_dataset_is_seeded_and_can_repeat(tmp_path):
    reqs = [Request([101 + i], 1, 1) for i in range(5)]
    assert sample_requests(reqs, 3, 0) == sample_requests(reqs, 3, 0)
    assert len({r.prompt[0] for r in sample_requests(reqs, 5, 0)}) == 5
    assert len(sample_requests(reqs, 12, 0)) == 12
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": [101 + i]}) for i in range(5)])
    spec = WorkloadSpec(dataset="jsonl", dataset_path=str(path), num_prompts=3)
    assert make_workload(spec, tokenizer=None) == make_workload(spec, tokenizer=None)
    with pytest.raises(ValueError, match="needs --dataset-path"):
        make_workload(WorkloadSpec(dataset="sharegpt"), tokenizer=None)


def test_copy_prompts_ask_to_repeat_a_passage_as_long_as_the_output(tokenizer):
    from iterserve.bench.workloads import COPY_INSTRUCTION, SENTENCES

    requests = make_workload(WorkloadSpec(dataset="copy", num_prompts=3, input_len="uniform:40:60", seed=1),
                             tokenizer=tokenizer)
    for r in requests:
        (message,) = r.prompt
        passage = message["content"].removeprefix(COPY_INSTRUCTION)
        assert message["content"].startswith(COPY_INSTRUCTION) and any(s.startswith(passage[:30]) for s in SENTENCES)
        assert r.output_len == len(tokenizer.encode(passage, add_special_tokens=False))
        assert r.prompt_len == len(tokenizer.apply_chat_template(r.prompt, tokenize=True)) > r.output_len
    with pytest.raises(ValueError, match="tokenizer"):
        make_workload(WorkloadSpec(dataset="copy"), tokenizer=None)
