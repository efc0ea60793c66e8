"""iterserve: iteration-level batching over a paged KV cache."""
