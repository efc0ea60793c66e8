"""Tokenizers for the models we serve, built from a GGUF file or a Hugging Face folder.

The backend is always a Hugging Face ``tokenizers.Tokenizer``. A GGUF's vocabulary becomes that pipeline in
:mod:`iterserve.formats.gguf.vocab`. Chat templates are checked and rendered (by transformers' renderer) in
:mod:`iterserve.tokenizer.chat_template`, :mod:`iterserve.tokenizer.hf` wraps the pipeline in the transformers
object ``LLM.get_tokenizer()`` returns, and `IncrementalDetokenizer` turns a stream of generated ids into text
deltas for streaming responses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, overload

import gguf
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

from iterserve.formats.gguf.reader import open_gguf
from iterserve.formats.gguf.vocab import gguf_vocabulary
from iterserve.tokenizer.chat_template import normalize_messages, render_chat_template

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")

# Special tokens that end a turn or a document. llama.cpp stops on these (its "EOG" set) even when
# the file names another token as eos; chat models emit them interchangeably.
_END_OF_GENERATION_TEXTS = frozenset({
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
    "<end_of_turn>", "<EOT>", "<end_of_utterance>", "<|return|>", "<|call|>",
})

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
        vocab = gguf_vocabulary(reader, name)
        _mark_named_special_tokens(vocab.backend, vocab.special_tokens.values())
        return cls(
            vocab.backend,
            special_tokens=vocab.special_tokens,
            special_token_ids=vocab.special_token_ids,
            chat_templates={"default": vocab.chat_template} if vocab.chat_template else None,
            extra_eos_token_ids=vocab.extra_eos_token_ids,
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

    @overload
    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], /, add_generation_prompt: bool = ...,
        tokenize: Literal[False] = ..., tools: Sequence[Mapping[str, Any]] | None = ..., **kwargs: Any,
    ) -> str: ...

    @overload
    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], /, add_generation_prompt: bool = ..., *,
        tokenize: Literal[True], tools: Sequence[Mapping[str, Any]] | None = ..., **kwargs: Any,
    ) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation into the prompt the model was trained on (or with ``chat_template``).

        Extra ``kwargs`` become template variables (and override bos_token and friends, as in
        transformers). With ``continue_final_message`` the prompt ends inside the last message, so
        the model carries it on (transformers' rule: the text after its content is cut). With
        ``tokenize`` the prompt is encoded without adding special tokens, because the template already
        wrote the ones the model expects.
        """
        if continue_final_message and (add_generation_prompt or not messages):
            raise ValueError("continue_final_message needs a final message and add_generation_prompt=False")
        template = chat_template if chat_template is not None else self._select_template(tools)
        if tools is not None and (
            isinstance(tools, (str, bytes, Mapping)) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise ValueError("tools must be a list of JSON-schema dicts")
        variables = {**self.special_tokens, **kwargs}
        prompt = render_chat_template(template, normalize_messages(messages), tools=[dict(t) for t in tools]
                                      if tools is not None else None, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message, **variables)
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
    can span several tokens, and decoders strip or merge across token boundaries. ``tokenizers``'
    :class:`~tokenizers.decoders.DecodeStream` does it right in a short window of context and holds
    back an incomplete character; what it still holds at the end (a character that never
    completed) comes out of :meth:`flush` as U+FFFD. The deltas, followed by ``flush()``,
    concatenate to ``decode(all_ids)`` exactly.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._stream = DecodeStream(skip_special_tokens=False)  # skipped ids never reach it
        self._emitted: list[int] = []  # the ids of the last delta: context for flush()
        self._pending: list[int] = []  # ids fed since then, not yet text

    def feed(self, ids: int | Iterable[int]) -> str:
        """Add ids; return the text they complete ("" while a character is still partial)."""
        deltas = []
        for token_id in [ids] if isinstance(ids, int) else ids:
            if token_id in self._skip:
                continue
            self._pending.append(token_id)
            delta = self._stream.step(self._tokenizer.backend, token_id)
            if delta is not None:
                deltas.append(delta)
                self._emitted, self._pending = self._pending, []
        return "".join(deltas)

    def flush(self) -> str:
        """Emit whatever is held back (e.g. a U+FFFD that never completed); call once at the end."""
        if not self._pending:
            return ""
        decode = self._tokenizer.decode
        delta = decode(self._emitted + self._pending, skip_special_tokens=False)
        delta = delta[len(decode(self._emitted, skip_special_tokens=False)):]
        self._emitted, self._pending = self._emitted + self._pending, []
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
