"""OpenAI-compatible HTTP serving: ``build_app`` around an engine, ``run_server`` for the CLI."""

from iterserve.server.api_server import build_app, run_server

__all__ = ["build_app", "run_server"]
