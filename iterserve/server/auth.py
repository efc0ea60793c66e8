"""The API key check, shared by the middleware and the dashboard (which also takes a session cookie)."""

from __future__ import annotations

import hmac


def bearer_matches(authorization: str, key: bytes) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>``, compared in constant time."""
    scheme, _, token = authorization.partition(" ")
    # header values arrive latin-1 decoded; encoding back gives the client's bytes
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), key)
