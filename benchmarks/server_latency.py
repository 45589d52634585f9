"""Latency and throughput of ``eaglewire serve`` under concurrent clients (SmolLM2-135M by default).

Starts the server as a subprocess on loopback (without a draft, then with ``--draft`` if given),
drives it with the official openai client from 1, 4 and 8 concurrent threads, each streaming
``--requests`` chat completions of MT-bench first turns (greedy), and prints a markdown table:
time to first token (TTFT: request sent -> first text chunk), per-token latency (first -> last
text chunk over the tokens after the first), throughput (all completion tokens / wall time)
and the accept length the server's /metrics reports for the run.

    python benchmarks/server_latency.py [--draft DIR] [--spec 5,4,12,0.1] [--clients 1,4,8]
        [--requests 4] [--max-tokens 64] [--threads 2] [--target smollm2-135m]

``--spec`` sets the server's draft shape: steps, top-k, draft tokens and optionally
``--draft-min-prob`` (default: the server's defaults).
"""

from __future__ import annotations

import argparse
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from openai import OpenAI

from eaglewire.bench.bench_command import parse_config
from eaglewire.core.presets import DEFAULT_TARGET
from eaglewire.core.prompts import load_prompts

SERVER = """
import logging, sys, torch
torch.set_num_threads({threads})
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from eaglewire.decode.spec_config import SpecConfig
from eaglewire.serve.app import serve
from eaglewire.serve.serve_config import ServeConfig
serve(ServeConfig(target={target!r}, draft={draft!r}, port={port}, max_queue=256, device="cpu", spec=SpecConfig(**{spec!r})))
"""


@dataclass
class Sample:
    ttft: float
    per_token: float | None  # None for a one-token answer
    tokens: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spec_flags(text: str | None) -> dict:
    """"5,4,12[,0.1]" -> the SpecConfig fields of the draft shape ({} for the defaults); parsed as
    bench parses its configs (a bench config without the batch)."""
    if not text:
        return {}
    try:
        spec = parse_config(f"1,{text}")
    except ValueError as e:
        raise SystemExit(f"--spec wants steps,topk,draft_tokens[,min_prob]: {e}") from None
    if spec is None:
        raise SystemExit(f"--spec {text!r} is plain decoding: leave --draft out instead")
    return asdict(spec)


def start_server(target: str, draft: str | None, threads: int, spec: dict) -> tuple[subprocess.Popen, str]:
    """The server in its own process (its own GIL); returns once /health answers."""
    port = free_port()
    code = SERVER.format(threads=threads, target=target, draft=draft, port=port, spec=spec if draft else {})
    proc = subprocess.Popen([sys.executable, "-c", code])
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}")


def wait_healthy(proc: subprocess.Popen, url: str, log: str = "its output", seconds: float = 300) -> str:
    """``url`` once the server in ``proc`` answers /health; stopped, and an error naming ``log``, otherwise."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before answering /health; see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return url
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"the server did not answer /health within {seconds:g} s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()  # SIGTERM: uvicorn's graceful shutdown
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def accept_totals(url: str) -> tuple[float, float]:
    """(sum, count) of the server's accept-length histogram."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    get = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # noqa: E731
    return get("eaglewire_accept_length_sum"), get("eaglewire_accept_length_count")


def one_request(client: OpenAI, model: str, prompt: str, max_tokens: int) -> Sample:
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    first, last = first or time.perf_counter(), last or time.perf_counter()
    per_token = (last - first) / (tokens - 1) if tokens > 1 else None
    return Sample(first - sent, per_token, tokens)


def run_level(url: str, model: str, prompts: list[str], clients: int, requests: int,
              max_tokens: int) -> dict[str, float]:
    """``clients`` threads, each sending ``requests`` streamed requests one after another."""

    def worker(i: int) -> list[Sample]:
        c = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        return [one_request(c, model, prompts[(i * requests + j) % len(prompts)], max_tokens)
                for j in range(requests)]

    s0, n0 = accept_totals(url)
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        samples = [s for batch in pool.map(worker, range(clients)) for s in batch]
    wall = time.perf_counter() - start
    s1, n1 = accept_totals(url)
    per_token = [s.per_token for s in samples if s.per_token is not None]
    return {"ttft_p50": statistics.median(s.ttft for s in samples),
            "ttft_max": max(s.ttft for s in samples),
            "per_token_ms": 1000 * statistics.median(per_token) if per_token else float("nan"),
            "throughput": sum(s.tokens for s in samples) / wall,
            "accept_length": (s1 - s0) / max(n1 - n0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=None, help="also measure with this draft directory")
    ap.add_argument("--spec", default=None, help="the draft shape: steps,topk,draft_tokens[,min_prob]")
    ap.add_argument("--clients", default="1,4,8", help="comma-separated concurrency levels")
    ap.add_argument("--requests", type=int, default=4, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    args = ap.parse_args()
    levels = [int(x) for x in args.clients.split(",")]
    spec = spec_flags(args.spec)
    prompts = [p.text for p in load_prompts("mt-bench", 16)]
    print(f"{args.target}, server on CPU with {args.threads} threads, {args.requests} streamed requests per client, "
          f"max_tokens {args.max_tokens}, greedy" + (f", draft shape {args.spec}" if args.spec else "") + "\n")
    print("| draft | clients | TTFT p50 (s) | TTFT max (s) | per-token (ms) | throughput (tok/s) | accept length |")
    print("|---|---|---|---|---|---|---|")
    for draft in [None] + ([args.draft] if args.draft else []):
        proc, url = start_server(args.target, draft, args.threads, spec)
        try:
            for clients in levels:
                r = run_level(url, args.target, prompts, clients, args.requests, args.max_tokens)
                print(f"| {draft or 'none'} | {clients} | {r['ttft_p50']:.2f} | {r['ttft_max']:.2f} | "
                      f"{r['per_token_ms']:.1f} | {r['throughput']:.1f} | {r['accept_length']:.2f} |", flush=True)
        finally:
            stop_server(proc)


if __name__ == "__main__":
    main()
