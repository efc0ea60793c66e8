"""GGUF, llama.cpp's single-file checkpoint, read in one place: the file and its metadata (:mod:`.reader`), the
tensor types and their block sizes (:mod:`.types`), the tensors under Hugging Face names (:mod:`.tensors`) and
the tokenizer vocabulary (:mod:`.vocab`). The weights the tensors become, and the kernels that multiply them,
live in :mod:`iterserve.quantization`."""
