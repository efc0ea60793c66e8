"""Speculative decoding inside continuous batching.

A proposer drafts up to k tokens for each decoding sequence after every step (:mod:`.ngram`: lookup
in the sequence's own tokens; :mod:`.draft`: a small draft model with its own paged KV cache); the
scheduler verifies them in the next step as 1 + k tokens of that sequence inside the step's token
budget; the sampler accepts a prefix of them by the rejection-sampling rule
(:mod:`.rejection_sampler`) and samples one more; the scheduler counts only accepted tokens as
computed and returns the blocks past them. :mod:`.stats` counts drafts and acceptances as vLLM does.
"""
