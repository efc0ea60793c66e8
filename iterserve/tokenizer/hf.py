"""A transformers ``PreTrainedTokenizerFast`` for a model's tokenizer, the object vLLM's ``LLM.get_tokenizer()``
returns: scripts written for vLLM call it (``convert_ids_to_tokens``, ``all_special_ids``, ``__call__``, ...).
"""

from __future__ import annotations

from tokenizers import Tokenizer as BackendTokenizer
from transformers import PreTrainedTokenizerFast

from iterserve.tokenizer.tokenizer import Tokenizer


def to_transformers(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """The same pipeline (a copy of its backend, so transformers' padding and truncation settings do not
    reach ours), with bos/eos/unk/pad and the default chat template set."""
    backend = BackendTokenizer.from_str(tokenizer.backend.to_str())
    special = {name: text for name, text in tokenizer.special_tokens.items() if text is not None}
    templates = tokenizer.chat_templates
    # transformers takes several named templates ("tool_use") as a dict, as tokenizer_config.json lists them
    template = templates if len(templates) > 1 else tokenizer.chat_template
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **special)
