"""A GGUF file's tokenizer metadata -> a Hugging Face ``tokenizers`` pipeline.

A GGUF stores only a vocabulary, merges and special-token ids, so we rebuild the pipeline
transformers' GGUF conversion builds from them: token ids must match what the model was trained on,
and the tests hold us to transformers' output for every pre-tokenizer named here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from iterserve.formats.gguf.reader import gguf_field

# llama.cpp token_type values (gguf.TokenType).
_CONTROL = 3
_USER_DEFINED = 4

# How text is split before byte-level BPE, by `tokenizer.ggml.pre`. A vocabulary's merges were
# learned on pieces cut this way; any other `pre` (SmolLM2's "smollm", for one) gets GPT-2's split,
# the ByteLevel default. The regexes are transformers' for the same names; only names tested against
# transformers are listed (tests/tokenizer/test_tokenizer.py).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZER_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,  # Llama 3 and 3.1
    "qwen2": _QWEN2_SPLIT,  # Qwen2, Qwen2.5, Qwen3
}

# SentencePiece vocabularies that transformers builds otherwise than Llama's (its GGUF Gemma tokenizer)
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})


@dataclass
class GGUFVocabulary:
    """What a GGUF says about its tokenizer: the backend (added tokens and BOS/EOS processor in
    place), the special tokens' texts and ids, the chat template and extra end-of-generation ids."""

    backend: BackendTokenizer
    special_tokens: dict[str, str | None]
    special_token_ids: dict[str, int | None]
    chat_template: str | None
    extra_eos_token_ids: list[int]


def gguf_vocabulary(reader: gguf.GGUFReader, name: str) -> GGUFVocabulary:
    """Read the tokenizer from an open GGUF; ``name`` labels errors."""

    def field(key: str) -> Any:
        return gguf_field(reader, key)

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
        scores = field("tokenizer.ggml.scores")
        if merges is None and scores is None:
            raise ValueError(f"{name}: a 'llama' tokenizer needs tokenizer.ggml.merges or tokenizer.ggml.scores")
        backend = _gemma_backend(tokens) if arch in _GEMMA_ARCHS else _sentencepiece_backend(tokens, merges, scores)
        if arch == "phi3":  # its prefix space comes from a normalizer (transformers' GGUF Phi-3 tokenizer)
            backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                       normalizers.Replace(" ", "\u2581")])
            backend.pre_tokenizer = None
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
    _set_bos_eos_processor(backend, texts["bos_token"], ids["bos_token"], bool(add_bos),
                           texts["eos_token"], ids["eos_token"], bool(field("tokenizer.ggml.add_eos_token")))
    extra_eos = [field(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    return GGUFVocabulary(backend, texts, ids, field("tokenizer.chat_template"),
                          [i for i in extra_eos if i is not None])


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
        vocab=vocab, merges=_merge_pairs(merges), dropout=None,
        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
    ))
    split = GGUF_PRE_TOKENIZER_SPLITS.get(pre or "")
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
        merge_pairs = _merge_pairs(merges)
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


def _gemma_backend(tokens: list[str]) -> BackendTokenizer:
    """Gemma's SentencePiece vocabulary as transformers builds it from a GGUF (``GemmaTokenizer``): spaces become
    "\u2581" before BPE, with no prefix space; a token of spaces alone, stored as spaces, is spelled in "\u2581";
    the file has no merges and its order, not its scores, ranks the ones rebuilt from the vocabulary."""
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    backend = BackendTokenizer(models.BPE(
        vocab=vocab, merges=_merges_from_scores(vocab, {t: -i for i, t in enumerate(spelled)}), fuse_unk=True,
        unk_token="<unk>", byte_fallback=True, dropout=None,
    ))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    """GGUF writes each merge as one string, the two pieces separated by a space."""
    return [(left, right) for left, _, right in (m.partition(" ") for m in merges)]


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


def _set_bos_eos_processor(
    backend: BackendTokenizer,
    bos: str | None, bos_id: int | None, add_bos: bool,
    eos: str | None, eos_id: int | None, add_eos: bool,
) -> None:
    """Install the post-processor that adds BOS/EOS on encode, shaped like transformers' own."""
    bos_token = (bos, bos_id) if add_bos and bos is not None and bos_id is not None else None
    eos_token = (eos, eos_id) if add_eos and eos is not None and eos_id is not None else None
    single = f"{f'{bos_token[0]}:0 ' if bos_token else ''}$A:0{f' {eos_token[0]}:0' if eos_token else ''}"
    pair = f"{single}{f' {bos_token[0]}:1' if bos_token else ''} $B:1{f' {eos_token[0]}:1' if eos_token else ''}"
    special = [t for t in (bos_token, eos_token) if t is not None]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
