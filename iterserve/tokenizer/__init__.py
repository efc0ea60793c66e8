"""Tokenizers for the models we serve (:mod:`.tokenizer`), built from a GGUF file's vocabulary
(:mod:`iterserve.formats.gguf.vocab`) or a Hugging Face folder, with their chat templates (:mod:`.chat_template`)
and streaming detokenization."""

from iterserve.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
