"""A small JSON client for OpenAI-compatible servers (stdlib only), with the retry policy of
remote regeneration.

Failures fall in three kinds:
  transient  the server may answer later: connection errors, timeouts, 408, 429, 5xx. Retried
             with exponential backoff (a ``Retry-After`` header is honoured), over the servers
             in turn; ``ServerUnavailable`` when every attempt failed.
  refused    the request itself is at fault (400, 413, 422, other 4xx): ``RequestRefused``; the
             caller counts the conversation as skipped with the server's reason.
  setup      the run cannot work at all (401, 403, 404, 405: a wrong URL, route or API key):
             ``ServerUnavailable`` at once, never retried.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_SETUP = frozenset({401, 403, 404, 405})
_TRANSIENT = frozenset({408, 409, 425, 429})
MAX_BACKOFF = 30.0  # seconds between two attempts at most (a Retry-After is capped at twice that)


class ServerUnavailable(RuntimeError):
    """No server answered usefully (after the retries, or a setup error); names the URL and why."""


class RequestRefused(ValueError):
    """The server refused the request as malformed or too large (a 4xx that is the request's fault)."""

    def __init__(self, url: str, status: int, reason: str) -> None:
        super().__init__(f"{url} answered {status}: {reason}")
        self.url, self.status, self.reason = url, status, reason


class _Transient(Exception):
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Client:
    """One server: ``url`` is its base (``http://host:port``; a trailing ``/v1`` is dropped)."""

    url: str
    api_key: str | None = None
    timeout: float = 600.0
    on_answer: Callable[[Any], None] | None = None  # sees every answer of a POST (e.g. to release what it names)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/").removesuffix("/v1")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--server {self.url!r} is not an http(s) URL; give e.g. http://127.0.0.1:8000")

    def get(self, path: str) -> Any:
        return self._request("GET", path, None)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        answer = self._request("POST", path, body)
        if self.on_answer is not None:
            self.on_answer(answer)
        return answer

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        url = self.url + path
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                text = r.read()
        except urllib.error.HTTPError as e:
            reason = _reason(e.read())
            if e.code in _SETUP:
                raise ServerUnavailable(f"{url} answered {e.code} ({reason}): check --server (the base URL, "
                                        "e.g. http://127.0.0.1:8000) and the API key") from e
            if e.code in _TRANSIENT or e.code >= 500:
                raise _Transient(f"{url} answered {e.code}: {reason}", _retry_after(e.headers)) from e
            raise RequestRefused(url, e.code, reason) from e
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as e:
            raise _Transient(f"{url}: {getattr(e, 'reason', e)}") from e
        try:
            return json.loads(text)
        except ValueError as e:
            raise _Transient(f"{url} answered with text that is not JSON: {text[:200]!r}") from e


def _reason(body: bytes) -> str:
    """The message of an error body (OpenAI's {"error": {"message"}}, FastAPI's {"detail"}), else its text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body[:300].decode(errors="replace").strip() or "no message"
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data))
        if isinstance(error, dict):
            error = error.get("message", error)
        return str(error)[:300]
    return str(data)[:300]


def _retry_after(headers: Any) -> float | None:
    try:
        return float(headers.get("Retry-After")) if headers and headers.get("Retry-After") else None
    except ValueError:
        return None


@dataclass
class RetryPolicy:
    retries: int = 5  # attempts after the first
    backoff: float = 1.0  # seconds before the first retry; doubled after each


def with_retries(call: Callable[[Client], T], clients: Sequence[Client], *, start: int, policy: RetryPolicy,
                 on_retry: Callable[[], None] | None = None) -> T:
    """``call(client)`` on ``clients[start]``, a transient failure retried on the next server in turn
    after a backoff; RequestRefused passes through; ServerUnavailable when all attempts failed."""
    last = ""
    for attempt in range(policy.retries + 1):
        client = clients[(start + attempt) % len(clients)]
        try:
            return call(client)
        except _Transient as e:
            last = str(e)
            if attempt == policy.retries:
                break
            wait = min(policy.backoff * 2 ** attempt, MAX_BACKOFF)
            if e.retry_after is not None:
                wait = max(wait, min(e.retry_after, 2 * MAX_BACKOFF))
            log.debug("%s; retrying in %.2f s (attempt %d of %d)", last, wait, attempt + 2, policy.retries + 1)
            if on_retry is not None:
                on_retry()
            time.sleep(wait)
    raise ServerUnavailable(f"no server answered after {policy.retries + 1} attempt(s); last: {last}. "
                            "What is written so far is kept: run the same command again to resume")


def call_once(call: Callable[[Client], T], client: Client) -> T:
    """``call(client)`` without retries; a transient failure is ServerUnavailable."""
    try:
        return call(client)
    except _Transient as e:
        raise ServerUnavailable(str(e)) from e
