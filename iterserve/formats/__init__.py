"""Checkpoint file formats, read below both the model loader and the tokenizer (GGUF: :mod:`.gguf`)."""
