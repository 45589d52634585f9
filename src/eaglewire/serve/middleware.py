"""ASGI middleware around ``eaglewire serve``'s app: the body's size and arrival time (413, 408),
the bearer API key (401), and every response counted by route and status for /metrics.
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi.responses import JSONResponse

from eaglewire.serve.api_errors import error_body
from eaglewire.serve.metrics import Metrics


class CountRequests:
    """ASGI middleware: count every HTTP response by route and status for /metrics."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.count_request(scope["path"], status)


class BearerAuth:
    """ASGI middleware: /v1 routes, and /metrics unless ``metrics_public``, need ``Authorization:
    Bearer <api_key>`` (checked before the body; the scheme is case-insensitive, as RFC 9110 has it)."""

    def __init__(self, app, api_key: str, metrics_public: bool = False) -> None:
        self.app, self.expected, self.metrics_public = app, api_key.encode(), metrics_public

    def _guarded(self, path: str) -> bool:
        return path.startswith("/v1") or (path == "/metrics" and not self.metrics_public)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self._guarded(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"").strip()
            scheme, _, key = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.expected):
                if not given or (scheme.lower() == b"bearer" and not key.strip()):
                    why = "no API key was given"
                elif scheme.lower() != b"bearer":
                    why = f"the Authorization scheme is {scheme.decode(errors='replace')!r}, not Bearer"
                else:
                    why = "the API key is wrong"
                body = error_body(f"{why}; send the server's --api-key as 'Authorization: Bearer KEY'",
                                  code="invalid_api_key")
                response = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class LimitBody:
    """ASGI middleware: a request body over ``max_bytes`` is refused with 413 before anything parses
    it — at once by its Content-Length, else as soon as the bytes received pass the limit — and one
    not received whole within ``timeout`` seconds with 408 (a client that declares more than it
    sends would otherwise hold its connection, and a slot of uvicorn's, forever)."""

    def __init__(self, app, max_bytes: int, timeout: float | None = None) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(f"{int(declared)} bytes", scope, receive, send)
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout(self.timeout):
                size = 0
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client left before sending it all
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_bytes:
                        return await self._refuse(f"more than {self.max_bytes} bytes", scope, receive, send)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            body = error_body(f"the request body did not arrive within {self.timeout:g} s (--request-timeout): "
                              f"{sum(map(len, chunks))} of {declared.decode() or 'an unknown number of'} bytes came; "
                              "send the whole body, or as many bytes as Content-Length says", code="request_timeout")
            return await JSONResponse(body, 408, headers={"Connection": "close"})(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:  # later reads: disconnect detection
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, size: str, scope, receive, send) -> None:
        body = error_body(f"the request body is {size}, over this server's limit of {self.max_bytes} bytes "
                          f"(--max-request-bytes); send a shorter request or raise the limit")
        await JSONResponse(body, 413)(scope, receive, send)
