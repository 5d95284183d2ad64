"""API keys of engine servers: when one is needed (a server bound beyond loopback), how it travels
(``$MEGAFORGE_ENGINE_API_KEY`` for the embedded server, which keeps it out of ``ps``) and how a
request shows it (``Authorization: Bearer <key>``, SGLang's ``--api-key`` rule)."""
from __future__ import annotations

import secrets

API_KEY_ENV = "MEGAFORGE_ENGINE_API_KEY"


def new_api_key() -> str:
    return secrets.token_urlsafe(24)


def engine_api_key(configured: str, loopback: bool) -> str:
    """``configured`` (``rollout.api_key``), else none for servers bound to a loopback address
    (``loopback``: :func:`megaforge.net.is_loopback` of ``rollout.host``), else a fresh key."""
    return configured or ("" if loopback else new_api_key())


def bearer_ok(authorization: str, api_key: str) -> bool:
    """Whether an ``Authorization`` header carries ``api_key`` as a bearer token (constant-time compare)."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), api_key.encode())
