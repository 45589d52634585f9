"""What a running server says it accepted: the one shape every engine's reading of its own counters
fills (``measure_served`` in sglang.py, vllm.py, eaglewire.py, llamacpp/server.py), and the HTTP
and Prometheus plumbing they share.

Two kinds of source, stated in ``source``: *per-request* figures (SGLang's ``meta_info``, vLLM's
``metrics.speculative_decoding``, llama.cpp's ``timings``) belong to the requests sent and to
nothing else; *counters* (the Prometheus totals) are read before and after the requests and
subtracted, so traffic from other clients between the two reads counts too.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

OTHER_TRAFFIC = ("counters are the server's totals read before and after these requests: traffic from other "
                 "clients in between counts too (measure on an idle server, or use per-request metrics)")


class ServedError(RuntimeError):
    """A server that does not answer, or answers something eaglewire cannot read."""


class AcceptanceRates:
    """The rates of a count of drafts (``drafts``, ``draft_tokens``, ``accepted``, ``accepted_per_pos``),
    the same for a server's own account and for the doctor's replay of it."""

    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: list[int]

    @property
    def tau(self) -> float:
        """Tokens per verify step, bonus included: 1 + accepted / drafts (vLLM's and llama.cpp's
        "mean acceptance length")."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def per_position(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_pos]


@dataclass
class ServedCounts(AcceptanceRates):
    """One engine's own account of the doctor's requests."""

    engine: str
    drafts: int = 0  # verify steps that checked a draft (vLLM's num_drafts, llama.cpp's verify steps)
    draft_tokens: int = 0  # drafted tokens proposed
    accepted: int = 0  # drafted tokens accepted (the bonus token not counted)
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose position i (0 first) was accepted
    outputs: list[list[int]] = field(default_factory=list)  # generated token ids per prompt ([] when not returned)
    source: str = "counters"  # per-request | counters | mixed
    notes: list[str] = field(default_factory=list)
    others: OtherTraffic | None = None  # what the server did for other clients meanwhile (None: not readable)


@dataclass
class OtherTraffic:
    """What a server did for other clients while the doctor measured it, from its own counter of generated
    tokens and its gauge of running requests, read before the doctor's first request and after its last
    answer (the doctor sends one request at a time, so neither read sees one of its own in flight)."""

    generated: int | None = None  # tokens generated beyond the doctor's own between the reads (None: no counter)
    running: int = 0  # other requests in flight at either read (the larger)
    # the engine's acceptance itself moves with the requests beside a sequence (llama.cpp b11434), said why;
    # None where a request's own figures do not depend on the others (vLLM: its rounds do not move with load)
    load_changes_acceptance: str | None = None

    @property
    def busy(self) -> bool:
        return self.running > 0 or (self.generated or 0) > 0

    def describe(self) -> str:
        """What the reads saw: "3 other request(s) in flight and 512 tokens generated for other clients", or
        "no other client's request"."""
        seen = [f"{self.running} other request(s) in flight"] if self.running else []
        if self.generated:
            seen.append(f"{self.generated:,} tokens generated for other clients")
        return " and ".join(seen) or "no other client's request"


def other_traffic(*, generated: tuple[float | None, float | None], running: tuple[float | None, float | None],
                  own_tokens: int, requests: int, load_changes_acceptance: str | None = None) -> OtherTraffic:
    """The other clients' share of a server's work between two reads: ``generated`` its counter of generated tokens
    (before, after), ``running`` its running-requests gauge (before, after), ``own_tokens`` what the doctor's
    ``requests`` answers held. A counter may count a request's tokens otherwise by one (an end-of-sequence token,
    a first token from the prefill): up to one token a request is not called traffic."""
    before, after = generated
    extra = None if before is None or after is None else max(int(after - before) - own_tokens - requests, 0)
    return OtherTraffic(generated=extra, running=int(max(r or 0 for r in running)),
                        load_changes_acceptance=load_changes_acceptance)


def traffic_between(before: str | None, after: str | None, outputs: list[list[int]], *, generated: str,
                    running: str) -> OtherTraffic | None:
    """Other clients' work between two reads of a server's Prometheus text: the counter ``generated`` (tokens
    generated) and the gauge ``running`` (requests running), full sample names; None without both reads."""
    if before is None or after is None:
        return None
    rows = samples(before), samples(after)
    return other_traffic(generated=(total(rows[0], generated), total(rows[1], generated)),
                         running=(total(rows[0], running), total(rows[1], running)),
                         own_tokens=sum(map(len, outputs)), requests=len(outputs))


def per_pos_from_histogram(histogram: list[int]) -> list[int]:
    """Dense histogram [j] = verify steps that accepted exactly j drafted tokens -> [i] = steps
    that accepted position i (those with j > i)."""
    return [sum(histogram[i + 1:]) for i in range(max(len(histogram) - 1, 0))]


def add_lists(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def post_json(url: str, body: dict, *, timeout: float, who: str, error: type[Exception] = ServedError,
              hint: str = "; pass the server's base URL as --engine-url") -> dict:
    """POST ``body`` as JSON; the JSON answer, or ``error`` naming ``who`` answers at ``url``."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise error(f"{who} at {url} answered {e.code}: {e.read()[:500]!r}") from e
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        raise error(f"no {who} answers at {url}: {e}{hint}") from e
    except json.JSONDecodeError as e:
        raise error(f"{who} at {url} answered something that is not JSON ({e})") from e


def server_failed(error: Exception) -> bool:
    """Whether ``error`` (raised by ``post_json`` or ``get_text``) is the server's own failure on a request (an
    HTTP 5xx), not a server that cannot be reached or answers something else."""
    cause = error.__cause__
    return isinstance(cause, urllib.error.HTTPError) and cause.code >= 500


def get_text(url: str, *, timeout: float, who: str) -> str | None:
    """GET ``url`` as text; None when the server has no such route (404, 501: e.g. metrics off)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        if e.code in (404, 501):
            return None
        raise ServedError(f"{who} at {url} answered {e.code}: {e.read()[:500]!r}") from e
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        raise ServedError(f"no {who} answers at {url}: {e}; pass the server's base URL as --engine-url") from e


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus exposition text -> (sample name, labels, value), names as written (``_total`` kept)."""
    return [(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def total(rows: list[tuple[str, dict[str, str], float]], name: str) -> float | None:
    """The sum of ``name`` over all its label sets (several engines, models); None if absent."""
    values = [v for n, _, v in rows if n == name]
    return sum(values) if values else None


def by_label(rows: list[tuple[str, dict[str, str], float]], name: str, label: str) -> dict[int, float]:
    """``name`` summed per integer value of ``label`` (other labels summed over)."""
    out: dict[int, float] = {}
    for n, labels, v in rows:
        if n == name and str(labels.get(label, "")).isdigit():
            out[int(labels[label])] = out.get(int(labels[label]), 0.0) + v
    return out


def version_at(url: str, *, who: str, timeout: float = 30.0) -> str | None:
    """The ``version`` a server reports at ``GET /version`` (vLLM's route, and eaglewire serve's); None when it
    answers none."""
    import json

    try:
        text = get_text(url.rstrip("/") + "/version", timeout=timeout, who=who)
        return None if text is None else str(json.loads(text).get("version")) or None
    except (ServedError, ValueError, AttributeError):
        return None


def wait_healthy(url: str, *, exited, timeout: float, interval: float = 0.2, on_exit, on_timeout) -> None:
    """Poll ``url``/health until it answers 200: ``on_exit(returncode)`` raises when the process ends first
    (``exited()`` gives its return code, None while it runs), ``on_timeout()`` once ``timeout`` seconds pass."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rc = exited()
        if rc is not None:
            on_exit(rc)
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(interval)
    on_timeout()


def log_tail(path, lines: int) -> str:
    """The last ``lines`` lines of a launched server's log ("" before it exists): what a start failure quotes."""
    from pathlib import Path

    if path is None or not Path(path).exists():
        return ""
    return "".join(Path(path).read_text(errors="replace").splitlines(keepends=True)[-lines:])

