"""``eaglewire bench --concurrency 1,4,8``: every config under C requests at once, in eaglewire's engine.

C clients each send their next request the moment their last one ends (a closed loop over the bench's prompts):
the engine decodes C sequences together (continuous batching), a new request joining between steps. Per config and
C: aggregate tokens/s, time to first token and the mean gap between a request's later tokens (p50 / p99), and each
output compared with plain decoding's at the same C. A schedule from ``tune --concurrency`` runs as a row of its
own, beside plain and the fixed shapes, so the table says at a glance where it follows the better of the two.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from eaglewire.decode.batch_engine import BatchEngine
from eaglewire.decode.sampling import SamplingParams
from eaglewire.concurrency.schedule import Schedule
from eaglewire.decode.spec_decoder import SpecDecoder


@dataclass
class LoadRow:
    """One config at one concurrency."""

    name: str
    clients: int
    seconds: float
    outputs: list[list[int]]  # per prompt
    ttft: list[float]  # per request: from its joining to its first token, seconds
    per_token: list[float]  # per request: the mean gap between its later tokens, seconds
    speculative_steps: int = 0  # steps that drafted (a server engine: its requests' drafting rounds)
    steps: int = 0
    same_as_plain: int | None = None
    vs_plain: float | None = None
    streamed: bool = True  # tokens seen as they came; False: answers came whole (a server engine), no TTFT

    @property
    def tokens(self) -> int:
        return sum(map(len, self.outputs))

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def to_dict(self) -> dict:
        """JSON-ready: a figure not measured (no TTFT of answers that came whole) is None."""
        def figure(values: list[float], q: float, scale: float, digits: int) -> float | None:
            value = percentile(values, q)
            return None if value != value else round(scale * value, digits)

        return {"name": self.name, "clients": self.clients, "tokens": self.tokens, "seconds": round(self.seconds, 3),
                "tokens_per_second": round(self.tokens_per_second, 2), "vs_plain": self.vs_plain,
                "ttft_p50_s": figure(self.ttft, 50, 1, 4), "ttft_p99_s": figure(self.ttft, 99, 1, 4),
                "per_token_p50_ms": figure(self.per_token, 50, 1e3, 2),
                "per_token_p99_ms": figure(self.per_token, 99, 1e3, 2),
                "steps": self.steps, "speculative_steps": self.speculative_steps, "streamed": self.streamed,
                "same_as_plain": self.same_as_plain, "requests": len(self.outputs)}


@dataclass
class _Request:
    prompt: int
    joined: float
    first: float | None = None  # when its first token came (the prefill's)
    gap: float = float("nan")  # the mean time between its later tokens
    outputs: list[int] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``; nan for none."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * len(xs) + 0.5)) - 1))]


def closed_loop(engine: BatchEngine, prompts: list[list[int]], clients: int, *, max_new_tokens: int,
                stop_token_ids: set[int], temperature: float = 0.0, seed: int = 0, name: str = "",
                progress: bool = False) -> LoadRow:
    """Every prompt once, ``clients`` of them in flight at a time, through ``engine``."""
    waiting = deque(range(len(prompts)))
    running: dict[object, _Request] = {}
    done: dict[int, _Request] = {}
    steps = speculative = 0
    bar = tqdm(total=len(prompts), desc=f"{name} x{clients}", unit="request", disable=not progress)
    start = time.perf_counter()

    def finish(seq, request: _Request) -> None:
        now = time.perf_counter()
        request.outputs = seq.produced
        n = len(seq.produced)
        done[request.prompt] = request
        running.pop(seq, None)
        request.gap = (now - request.first) / (n - 1) if n > 1 else float("nan")
        bar.update()

    while waiting or running:
        while waiting and len(running) < clients:
            i = waiting.popleft()
            request = _Request(i, time.perf_counter())
            sampling = SamplingParams(temperature=temperature, seed=seed + i)
            seq = engine.add(prompts[i], max_new_tokens=max_new_tokens, sampling=sampling,
                             stop_token_ids=stop_token_ids)
            request.first = time.perf_counter()  # the prefill's token
            running[seq] = request
            if seq.finished:
                finish(seq, request)
        if not running:
            continue
        advanced = engine.step()
        steps += 1
        speculative += engine.last_shape is not None
        for seq in advanced:
            if seq.finished:
                finish(seq, running[seq])
    seconds = time.perf_counter() - start
    bar.close()
    ordered = [done[i] for i in range(len(prompts))]
    return LoadRow(name, clients, seconds, [r.outputs for r in ordered], [r.first - r.joined for r in ordered],
                   [r.gap for r in ordered if r.gap == r.gap], speculative, steps)


def bench_concurrency(decoders: dict[str, tuple[SpecDecoder, Schedule]], prompts: list[list[int]],
                      levels: list[int], *, max_new_tokens: int, stop_token_ids: set[int], temperature: float,
                      seed: int, warmup: int, progress: bool) -> list[LoadRow]:
    """Each named (decoder, schedule) at each concurrency, level-major (every config runs a level back to back, so
    a drift of the machine hits them alike); the first name is plain decoding, the others compared with it."""
    engines = {name: BatchEngine(decoder, schedule) for name, (decoder, schedule) in decoders.items()}
    for engine in engines.values():
        for prompt in prompts[:warmup]:
            closed_loop(engine, [prompt], 1, max_new_tokens=min(16, max_new_tokens), stop_token_ids=stop_token_ids)
    rows = []
    for clients in levels:
        level = [closed_loop(engine, prompts, clients, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                             temperature=temperature, seed=seed, name=name, progress=progress)
                 for name, engine in engines.items()]
        rows += compare_with_plain(level)
    return rows


def compare_with_plain(level: list[LoadRow]) -> list[LoadRow]:
    """One concurrency's rows (plain first), each given its outputs equal to plain's and its tokens/s over plain's."""
    plain = level[0]
    for row in level:
        row.same_as_plain = sum(a == b for a, b in zip(row.outputs, plain.outputs))
        row.vs_plain = round(row.tokens_per_second / plain.tokens_per_second, 3)
    return level


def table(rows: list[LoadRow]) -> str:
    """The rows as a terminal table, one line per config and concurrency."""
    head = (f"{'config':24} {'clients':>7} {'tok/s':>8} {'vs plain':>8} {'TTFT p50/p99 s':>15} "
            f"{'per token p50/p99 ms':>21} {'same as plain':>13} {'drafting steps':>14}")
    lines = [head]
    for r in rows:
        d = r.to_dict()
        ttft = f"{d['ttft_p50_s']:7.2f}/{d['ttft_p99_s']:<7.2f}" if r.streamed else f"{'-':>7}/{'-':<7}"
        drafting = f"{r.speculative_steps}/{r.steps}" if r.streamed else f"{r.speculative_steps} rounds"
        lines.append(f"{r.name:24} {r.clients:7} {d['tokens_per_second']:8.1f} {r.vs_plain or 0:7.2f}x "
                     f"{ttft} {d['per_token_p50_ms'] or 0:10.1f}/"
                     f"{d['per_token_p99_ms'] or 0:<10.1f} {f'{r.same_as_plain}/{len(r.outputs)}':>13} "
                     f"{drafting:>14}")
    if any(not r.streamed for r in rows):
        lines.append("a server engine answers whole: no time to first token; its per-token figure is a request's "
                     "time from sending to answer over its tokens; drafting: its requests' rounds")
    return "\n".join(lines)


def plot(rows: list[LoadRow], path: str | Path) -> Path:
    """Aggregate tokens/s against concurrency, one line per config."""
    from eaglewire.core.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.name for r in rows):
        mine = [r for r in rows if r.name == name]
        ax.plot([r.clients for r in mine], [r.tokens_per_second for r in mine], "o-", label=name)
    ax.set(xscale="log", xlabel="concurrent requests", ylabel="tokens/s (all requests)",
           title="throughput against concurrency")
    ax.set_xticks(sorted({r.clients for r in rows}), [str(c) for c in sorted({r.clients for r in rows})])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
