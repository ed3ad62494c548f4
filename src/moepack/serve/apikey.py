"""``--api-key``: the key both APIs then require (an ASGI middleware in front of everything).

A request to an API route (``/v1/…``, ``/api/…``, ``/extras/…``, llama-cpp-python's
tokenizer routes) must carry the key as OpenAI's and Ollama's clients send it
(``Authorization: Bearer KEY``) or as Anthropic's do (``x-api-key: KEY``) — either header on
any API, so one key serves every kind of client. A missing or wrong key is a 401 in the shape
of the API asked (``authentication_error`` for ``/v1/messages``, ``{"error"}`` for Ollama's
``/api/``, ``invalid_api_key`` for the others),
compared in constant time. The dashboard, ``/metrics`` and ``/metrics.json`` stay open: they
show figures, never text. The key reaches the worker in its environment, not on a command
line or in a file.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

ENV = "MOEPACK_SERVE_API_KEY"
OPEN = ("/", "/dashboard", "/dashboard.css", "/dashboard.js", "/metrics", "/metrics.json")


def presented(scope: Scope) -> str | None:
    """The key a request carries (``x-api-key``, else a bearer token)."""
    headers = {k.lower(): v for k, v in scope.get("headers", [])}
    key = headers.get(b"x-api-key")
    if key is not None:
        return key.decode("latin-1")
    auth = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class ApiKey:
    """The middleware (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] != "http" or path in OPEN or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        key = presented(scope)
        if key is not None and hmac.compare_digest(key.encode(), self.key):
            await self.app(scope, receive, send)
            return
        why = (
            "no API key (x-api-key or Authorization: Bearer)" if key is None else "invalid API key"
        )
        body: dict[str, object]
        if path.startswith("/v1/messages"):
            body = {"type": "error", "error": {"type": "authentication_error", "message": why}}
        elif path.startswith("/api/"):  # Ollama's shape (its clients send a bearer token)
            body = {"error": why}
        else:
            body = {
                "error": {
                    "message": why,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        payload = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload, "more_body": False})
