"""Benchmarks behind ``iterserve bench``: offline throughput by batching mode, an online load
generator for any OpenAI-compatible server, a batch-size sweep of the forward step, and charts."""
