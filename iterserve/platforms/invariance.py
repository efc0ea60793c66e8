"""Whether a model's outputs must not depend on what else runs with it (issue 45).

In bf16 and fp16 a sum's rounding depends on its order, so a row computed by another kernel, or with its
reductions cut another way, because of the rows around it, gives other logits and at times another greedy
token. Batch-invariant, each row's matmuls run the packed kernel (``csrc/linear.cpp``: one order over k per
row whatever the row count) rather than whichever method measured fastest, and every prompt token is attended
by the decode kernel, as decode tokens are, rather than by SDPA past a prompt length. The default in half
precision; ``ITERSERVE_BATCH_INVARIANT=0`` turns it off, ``=1`` turns it on in float32 too.
"""

from __future__ import annotations

import os

import torch

ENV_VAR = "ITERSERVE_BATCH_INVARIANT"
HALF_DTYPES = (torch.bfloat16, torch.float16)


def batch_invariant(dtype: torch.dtype) -> bool:
    """Whether a model in ``dtype`` runs the batch-invariant paths (the environment may turn them off or on)."""
    setting = os.environ.get(ENV_VAR, "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    return dtype in HALF_DTYPES
