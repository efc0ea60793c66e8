"""Tokenizers for the models we serve, built from a GGUF file or a Hugging Face folder.

The backend is always a Hugging Face ``tokenizers.Tokenizer``; transformers is not needed at run
time. A GGUF stores only a vocabulary, merges and special-token ids, so we rebuild the same
pipeline transformers' GGUF conversion builds from them: token ids must match what the model was
trained on, and the tests hold us to transformers' output.

Chat templates are rendered with jinja2 the way transformers renders them, and
`IncrementalDetokenizer` turns a stream of generated ids into text deltas for streaming responses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import gguf
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from iterserve.models.gguf_file import open_gguf

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")

# llama.cpp token_type values (gguf.TokenType).
_CONTROL = 3
_USER_DEFINED = 4

# Special tokens that end a turn or a document. llama.cpp stops on these (its "EOG" set) even when
# the file names another token as eos; chat models emit them interchangeably.
_END_OF_GENERATION_TEXTS = frozenset({
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
    "<end_of_turn>", "<EOT>", "<end_of_utterance>", "<|return|>", "<|call|>",
})

# How text is split before byte-level BPE, by `tokenizer.ggml.pre`. A vocabulary's merges were
# learned on pieces cut this way; any other `pre` gets GPT-2's split (the ByteLevel default).
# Same table as transformers' GGUF conversion.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}

# SentencePiece vocabularies whose GGUF needs a pipeline other than Llama's; transformers has
# per-architecture builders for these that we do not replicate.
_UNSUPPORTED_SENTENCEPIECE_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "phi3"})


class Tokenizer:
    """Text <-> token ids for one model, plus its special tokens and chat template.

    Build one with `from_gguf` or `from_pretrained_dir`; the constructor takes an already
    configured backend (normalizer, pre-tokenizer, decoder and BOS/EOS post-processor in place).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: Mapping[str, str | None],
        special_token_ids: Mapping[str, int | None] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        """``special_tokens`` maps bos_token/eos_token/unk_token/pad_token to their text (what
        chat templates see); ``special_token_ids`` overrides the ids looked up from that text
        (a GGUF states ids directly). ``chat_templates`` is keyed by name: "default", and
        "tool_use" where a model has a separate template for requests with tools."""
        self.backend = backend
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        ids = dict(special_token_ids or {})
        for name, text in self.special_tokens.items():
            if ids.get(name) is None:
                ids[name] = backend.token_to_id(text)
        self.bos_token_id: int | None = ids.get("bos_token")
        self.eos_token_id: int | None = ids.get("eos_token")
        self.unk_token_id: int | None = ids.get("unk_token")
        self.pad_token_id: int | None = ids.get("pad_token")
        self.chat_templates = dict(chat_templates or {})
        self.special_token_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        eos = set(extra_eos_token_ids)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        eos.update(
            i for i, t in backend.get_added_tokens_decoder().items()
            if t.special and t.content in _END_OF_GENERATION_TEXTS
        )
        self.eos_token_ids = frozenset(eos)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source: str | os.PathLike[str] | gguf.GGUFReader) -> Tokenizer:
        """Build the tokenizer a GGUF file describes; pass the loader's reader to avoid re-reading."""
        if isinstance(source, gguf.GGUFReader):
            reader, name = source, str(getattr(source.data, "filename", None) or "GGUF file")
        else:
            reader, name = open_gguf(source), os.fspath(source)

        def field(key: str) -> Any:
            f = reader.fields.get(key)
            return None if f is None else f.contents()

        tokens: list[str] | None = field("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError(f"{name} has no tokenizer vocabulary (tokenizer.ggml.tokens)")
        kind = field("tokenizer.ggml.model")
        token_types: list[int] = field("tokenizer.ggml.token_type") or []
        merges = field("tokenizer.ggml.merges")
        add_bos = field("tokenizer.ggml.add_bos_token")
        if kind == "gpt2":
            backend = _byte_level_backend(tokens, merges or [], field("tokenizer.ggml.pre"))
        elif kind == "llama":
            arch = field("general.architecture")
            if arch in _UNSUPPORTED_SENTENCEPIECE_ARCHS:
                raise ValueError(f"{name}: the SentencePiece tokenizer of architecture {arch!r} is not supported")
            scores = field("tokenizer.ggml.scores")
            if merges is None and scores is None:
                raise ValueError(f"{name}: a 'llama' tokenizer needs tokenizer.ggml.merges or tokenizer.ggml.scores")
            backend = _sentencepiece_backend(tokens, merges, scores)
            # Older files have no flag; llama.cpp adds BOS to a SentencePiece vocabulary unless told not to.
            add_bos = True if add_bos is None else add_bos
        else:
            raise ValueError(
                f"{name}: unsupported tokenizer model {kind!r} (tokenizer.ggml.model); supported: 'gpt2', 'llama'"
            )
        _add_gguf_added_tokens(backend, tokens, token_types, byte_level=kind == "gpt2")

        ids = {
            "bos_token": field("tokenizer.ggml.bos_token_id"),
            "eos_token": field("tokenizer.ggml.eos_token_id"),
            "unk_token": field("tokenizer.ggml.unknown_token_id"),
            "pad_token": field("tokenizer.ggml.padding_token_id"),
        }
        texts = {k: tokens[i] if i is not None and 0 <= i < len(tokens) else None for k, i in ids.items()}
        _mark_named_special_tokens(backend, texts.values())
        _set_bos_eos_processor(backend, texts["bos_token"], ids["bos_token"], bool(add_bos),
                               texts["eos_token"], ids["eos_token"], bool(field("tokenizer.ggml.add_eos_token")))
        template = field("tokenizer.chat_template")
        extra_eos = [field(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
        return cls(
            backend,
            special_tokens=texts,
            special_token_ids=ids,
            chat_templates={"default": template} if template else None,
            extra_eos_token_ids=[i for i in extra_eos if i is not None],
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a Hugging Face tokenizer folder: tokenizer.json plus the optional
        tokenizer_config.json, generation_config.json and chat_template.jinja.

        Whether BOS/EOS are added comes from tokenizer.json's post-processor alone: transformers
        (v5) ignores tokenizer_config's add_bos_token/add_eos_token when tokenizer.json exists,
        and the ids must match what it produces."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}: cannot build a tokenizer from this folder")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")

        _add_declared_tokens(backend, config.get("added_tokens_decoder", {}))
        texts = {name: _token_text(config.get(name)) for name in _NAMED_SPECIAL_TOKENS}
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        _mark_named_special_tokens(backend, [*texts.values(), *(_token_text(t) for t in extra)])

        templates = _named_templates(config.get("chat_template"))
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            templates["default"] = template_file.read_text(encoding="utf-8")

        gen_eos = generation.get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        # generation_config.json names ids only; they stand in for tokens the config leaves out
        fallback = {
            "bos_token": generation.get("bos_token_id"),
            "eos_token": gen_eos[0] if gen_eos else None,
            "pad_token": generation.get("pad_token_id"),
        }
        ids = {name: i for name, i in fallback.items() if texts[name] is None and isinstance(i, int)}
        return cls(backend, special_tokens=texts, special_token_ids=ids, chat_templates=templates,
                   extra_eos_token_ids=gen_eos)

    # -- encoding -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        """The default chat template, or None when the model ships without one."""
        return self.chat_templates.get("default")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; with ``add_special_tokens`` BOS/EOS are added only where the
        model's config asks for them (as transformers does).

        Goes through the batch call because, unlike ``encode``, it releases the GIL: a long text
        tokenized in a worker thread then leaves the server's event loop running."""
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on ``len(self.encode(text))`` found without tokenizing (0 where there is none).

        Lets a server refuse a prompt too long for its context without spending seconds on it. Costs
        one pass over the text's UTF-8 bytes (milliseconds per megabyte).
        """
        if self._length_bound is None:
            return 0
        max_token_bytes, unspellable = self._length_bound
        data = text.encode("utf-8", "surrogatepass")
        spelled = len(data.translate(None, unspellable)) if unspellable else len(data)
        return -(-spelled // max_token_bytes)

    @cached_property
    def _length_bound(self) -> tuple[int, bytes] | None:
        """(the most input bytes one token stands for, the bytes the vocabulary cannot spell), or None.

        Every spellable byte of input ends up in some token, and no token stands for more input
        than its own length, so ``spelled bytes / longest token`` bounds the count, provided no
        step drops or merges input: no normalizer, pre-tokenizers that only split text (or map
        characters one to one), a BPE model that spells each byte or drops it (never folds a run
        into one unknown token), added tokens that do not absorb the whitespace around them, and
        no truncation. The pipelines built here from GGUF files qualify; other tokenizer.json
        files may not.
        """
        spec = json.loads(self.backend.to_str())
        model, pre_tokenizer = spec["model"], spec.get("pre_tokenizer")
        if spec.get("normalizer") is not None or spec.get("truncation") is not None:
            return None
        if model.get("type") != "BPE" or not _keeps_characters(pre_tokenizer):
            return None
        added = spec.get("added_tokens") or []
        if any(t.get("lstrip") or t.get("rstrip") for t in added):
            return None
        vocab: dict[str, int] = model["vocab"]
        if _has_byte_level(pre_tokenizer):
            # A byte-level BPE skips a byte whose alphabet character is not in the vocabulary.
            alphabet = _bytes_to_unicode()
            unspellable = bytes(b for b, c in alphabet.items() if c not in vocab)
            spelled_in = set(alphabet.values())
            sizes = [len(t) if set(t) <= spelled_in else len(t.encode()) for t in vocab]
        elif model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
            unspellable = b""
            # a vocabulary character stands for at most its own bytes ("\u2581" for a 1-byte space)
            sizes = [len(t.encode()) for t in vocab]
        else:
            return None
        return max(sizes + [len(t["content"].encode()) for t in added]), unspellable

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry for an id (in the model's own spelling), None if out of range."""
        return self.backend.id_to_token(token_id)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming decoder for one generated sequence."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation into the prompt the model was trained on.

        Extra ``kwargs`` become template variables (and override bos_token and friends, as in
        transformers). With ``tokenize`` the prompt is encoded without adding special tokens,
        because the template already wrote the ones the model expects.
        """
        template = self._select_template(tools)
        if tools is not None and (
            isinstance(tools, (str, bytes, Mapping)) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise ValueError("tools must be a list of JSON-schema dicts")
        context = {
            **self.special_tokens,
            "tools": [dict(t) for t in tools] if tools is not None else None,
            "documents": None,
            **kwargs,
            "messages": _normalize_messages(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            prompt = _compile_template(template).render(**context)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc
        return self.encode(prompt, add_special_tokens=False) if tokenize else prompt

    def _select_template(self, tools: Sequence[Mapping[str, Any]] | None) -> str:
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        return self.chat_template


class IncrementalDetokenizer:
    """Turns generated ids, fed a few at a time, into text deltas for streaming.

    Decoding token by token is wrong for byte-level and byte-fallback vocabularies: one character
    can span several tokens, and decoders strip or merge across token boundaries. So we decode a
    short window (``prefix`` tokens already emitted, for context, plus the unread ones) and emit what
    it adds beyond the prefix's text, holding back while it ends in U+FFFD (an incomplete character).
    The window is dropped as soon as text is emitted, so each step costs O(window), not O(output).
    The deltas, followed by `flush()`, concatenate to ``decode(all_ids)`` exactly.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._window: list[int] = []  # ids from prefix_offset on
        self._read_offset = 0  # index in _window of the first id not yet turned into text
        self._prefix_text = ""  # decode(_window[:_read_offset])

    def feed(self, ids: int | Iterable[int]) -> str:
        """Add ids; return the text they complete ("" while a character is still partial)."""
        new = [ids] if isinstance(ids, int) else list(ids)
        self._window.extend(i for i in new if i not in self._skip)
        if len(self._window) == self._read_offset:
            return ""
        text = self._tokenizer.decode(self._window, skip_special_tokens=False)
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Emit whatever is held back (e.g. a U+FFFD that never completed); call once at the end."""
        if len(self._window) == self._read_offset:
            return ""
        return self._advance(self._tokenizer.decode(self._window, skip_special_tokens=False))

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text):]
        self._window = self._window[self._read_offset:]
        self._read_offset = len(self._window)
        self._prefix_text = self._tokenizer.decode(self._window, skip_special_tokens=False)
        return delta


# -- building backends ------------------------------------------------------------------------------


def _keeps_characters(pre_tokenizer: Mapping[str, Any] | None) -> bool:
    """Whether a serialized pre-tokenizer keeps every input character (it may split or respell them)."""
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in pre_tokenizer.get("pretokenizers", []))
    if kind in ("ByteLevel", "Metaspace", "Digits"):
        return True
    return kind in ("Split", "Punctuation") and pre_tokenizer.get("behavior") != "Removed"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character each byte is spelled with in the vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _has_byte_level(pre_tokenizer: Mapping[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in pre_tokenizer.get("pretokenizers", []))
    return pre_tokenizer.get("type") == "ByteLevel"


def _byte_level_backend(tokens: list[str], merges: list[str], pre: str | None) -> BackendTokenizer:
    """GPT-2 style byte-level BPE, as transformers builds it from a GGUF.

    A vocabulary entry is normally spelled in the byte alphabet; one that is not (a raw added token)
    is respelled byte by byte so that BPE can reach it.
    """
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    to_bytes_alphabet = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def spell(token: str) -> str:
        if set(token) <= alphabet:
            return token
        return "".join(piece for piece, _ in to_bytes_alphabet.pre_tokenize_str(token))

    vocab = {spell(token): index for index, token in enumerate(tokens)}
    backend = BackendTokenizer(models.BPE(
        vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
    ))
    split = _GGUF_PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(
    tokens: list[str], merges: list[str] | None, scores: list[float] | None
) -> BackendTokenizer:
    """Llama/Mistral SentencePiece vocabulary as BPE with byte fallback, as transformers builds it."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges is not None:
        merge_pairs = [tuple(m.split(" ")) for m in merges]
    else:
        merge_pairs = _merges_from_scores(vocab, dict(zip(tokens, scores or ())))
    backend = BackendTokenizer(models.BPE(
        vocab=vocab, merges=merge_pairs, fuse_unk=True, byte_fallback=True, dropout=None,
    ))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two pieces,
    best-scored piece first (the order transformers derives them in)."""
    merges: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score) for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_gguf_added_tokens(
    backend: BackendTokenizer, tokens: list[str], token_types: list[int], *, byte_level: bool
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so both
    are matched whole in text instead of being cut into pieces.

    In a byte-level vocabulary a control token spelled outside the byte alphabet is a llama.cpp
    mislabel; adding it would grow the vocabulary past the model's, so it is skipped.
    """
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if byte_level else None
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        if kind == _CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    if control:
        backend.add_special_tokens(control)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types)
        if kind == _USER_DEFINED and backend.token_to_id(token) is not None
    ]
    if user_defined:
        backend.add_tokens(user_defined)


def _add_declared_tokens(backend: BackendTokenizer, declared: Mapping[str, Mapping[str, Any]]) -> None:
    """Add tokenizer_config's added_tokens_decoder entries that tokenizer.json lacks, with their
    flags, when each lands on the id it declares (an entry that would not is inconsistent; skip it)."""
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    for token_id, spec in sorted(declared.items(), key=lambda kv: int(kv[0])):
        content = spec["content"]
        current = backend.token_to_id(content)
        lands_on = current if current is not None else backend.get_vocab_size(with_added_tokens=True)
        if content in added or lands_on != int(token_id):
            continue
        token = AddedToken(
            content, single_word=spec.get("single_word", False), lstrip=spec.get("lstrip", False),
            rstrip=spec.get("rstrip", False), normalized=spec.get("normalized", not spec.get("special", False)),
            special=spec.get("special", False),
        )
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])
        added.add(content)


def _mark_named_special_tokens(backend: BackendTokenizer, texts: Iterable[str | None]) -> None:
    """Make bos/eos/unk/pad (and listed extras) special added tokens, as transformers does, so they
    are matched whole and skipped when decoding. Unlike transformers, a text missing from the
    vocabulary is not appended as a new id: the model has no embedding for it."""
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = []
    for text in texts:
        if text and text not in added and backend.token_to_id(text) is not None:
            missing.append(AddedToken(text, special=True, normalized=False))
            added.add(text)
    if missing:
        backend.add_special_tokens(missing)


def _set_bos_eos_processor(
    backend: BackendTokenizer,
    bos: str | None, bos_id: int | None, add_bos: bool,
    eos: str | None, eos_id: int | None, add_eos: bool,
) -> None:
    """Install the post-processor that adds BOS/EOS on encode, shaped like transformers' own."""
    add_bos = add_bos and bos is not None and bos_id is not None
    add_eos = add_eos and eos is not None and eos_id is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    special = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _named_templates(value: Any) -> dict[str, str]:
    """tokenizer_config's chat_template: one string, or a list of {name, template} (e.g. tool_use)."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {item["name"]: item["template"] for item in value}
    return {}


# -- chat templates ---------------------------------------------------------------------------------


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the conversation's shape and return plain dicts with string content.

    Templates index message['content'] as a string, so a list of text parts (OpenAI's format) is
    joined with newlines. Keys whose value is None are dropped, as transformers does, because
    templates test for a key's presence rather than for None.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{index}] needs a non-empty string 'role'")
        content = message.get("content")
        if content is None:
            if not message.get("tool_calls"):
                raise ValueError(f"messages[{index}] needs 'content' (a string or a list of text parts)")
        elif isinstance(content, list):
            content = "\n".join(_text_part(part, index) for part in content)
        elif not isinstance(content, str):
            raise ValueError(
                f"messages[{index}]['content'] must be a string or a list of text parts, got {type(content).__name__}"
            )
        out = {key: value for key, value in message.items() if value is not None}
        if content is not None:
            out["content"] = content
        normalized.append(out)
    return normalized


def _text_part(part: Any, index: int) -> str:
    if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise ValueError(
            f"messages[{index}]['content'] has an unsupported part {part!r}; only {{'type': 'text', 'text': str}} parts are accepted"
        )
    return part["text"]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses; templates come with model
    files and are untrusted, hence the sandbox."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template does not compile: {exc}") from exc
