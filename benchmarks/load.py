"""`eaglewire serve` under load, one server at a time on loopback (SmolLM2-135M), four ways to load it:

    # latency: TTFT, per-token latency, throughput and accept length at 1, 4, 8 clients (plain, then --draft)
    python benchmarks/load.py latency [--draft DIR] [--spec 5,4,12,0.1] [--clients 1,4,8] [--requests 4]
        [--max-tokens 64] [--threads 2] [--target smollm2-135m]
    # concurrency: plain beside chain 1, chain 3 and tune's schedule at each concurrency, outputs against plain's
    OMP_NUM_THREADS=2 eaglewire tune --draft reference --concurrency 1,2,4,8,16 --schedule-out runs/schedule.json
    OMP_NUM_THREADS=2 python benchmarks/load.py concurrency --concurrency 1,2,4,8,16 \\
        --schedule runs/schedule.json --out runs/serve_concurrency.json
    # sustained: C clients for S seconds, mixed greedy/sampled, streamed/whole, some cancelled; no 5xx, memory flat
    OMP_NUM_THREADS=2 python benchmarks/load.py sustained --clients 32 --seconds 300 --schedule runs/schedule.json
    # alone: each reply a loaded server gives equals the reply it gives that request alone
    OMP_NUM_THREADS=2 python benchmarks/load.py alone --clients 8 --requests 24 --schedule runs/schedule.json

latency: the server is started in-process code (``serve(ServeConfig(...))``, max_queue 256) without a draft, then with
``--draft``; the official openai client streams ``--requests`` MT-bench first turns (greedy) from each of C threads.
TTFT: request sent -> first text chunk; per-token: first -> last text chunk over the tokens after the first;
throughput: all completion tokens / wall time; accept length: what /metrics reports for the run. ``--spec`` sets the
draft shape: steps, top-k, draft tokens and optionally ``--draft-min-prob`` (default: the server's defaults).

concurrency: ``eaglewire serve --max-batch 16``, one server per shape (plain; each draft's chain 1, chain 3 and
schedule where given), each started, measured at every concurrency, stopped. Each level sends ``max(2C,
--min-requests)`` greedy MT-bench requests from C clients: aggregate tokens/s, TTFT and the mean gap between later
tokens per request (p50 / p99). Two drafts side by side (each with its own schedule): ``--drafts
reference,new=runs/regen/draft --schedules new=runs/regen/schedule.json``.

sustained: a whole reply is a non-streamed answer with a finish reason and as many tokens as its usage says, or a
stream whose chunks end with a finish reason and ``data: [DONE]``. Memory: the server's resident size one minute in
and at the end (the first minute fills the caches every batch size needs), and their ratio. Exit 1 on a broken reply,
a 5xx or memory that grew by more than 10 %.

alone: C clients at once (greedy and seeded-sampled, streamed and whole, some streams closed early), then every whole
reply's request again, one at a time. Greedy replies must be equal; a seeded sampled one repeats only where the same
kind of step (plain or speculative) produced it, since a speculative round draws its random numbers otherwise than a
plain step does (the distribution is the target's either way): with a schedule that switches by load, it may not.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

# ---------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def stop_server(proc: subprocess.Popen, seconds: float = 30) -> None:
    proc.terminate()  # SIGTERM: uvicorn's graceful shutdown
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()


def chain(n: int, draft: str = "reference") -> list[str]:
    """serve's flags of a chain of ``n`` draft tokens."""
    return ["--draft", draft, "--speculative-num-steps", str(n), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(n + 1)]


SHAPES = {"plain": [], "chain 1": chain(1), "chain 3": chain(3)}  # sustained and alone: --server


def start_cli_server(args: list[str], threads: int, log_path: str) -> tuple[subprocess.Popen, str]:
    """``eaglewire serve --max-batch 16 ARGS`` in its own process; returns once /health answers."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "eaglewire.cli", "--threads", str(threads), "serve", "--target", "smollm2-135m",
           "--port", str(port), "--max-batch", "16", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}", log_path)


# ---------------------------------------------------------------- latency

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


def spec_flags(text: str | None) -> dict:
    """"5,4,12[,0.1]" -> the SpecConfig fields of the draft shape ({} for the defaults); parsed as
    bench parses its configs (a bench config without the batch)."""
    from eaglewire.bench.bench_command import parse_config

    if not text:
        return {}
    try:
        spec = parse_config(f"1,{text}")
    except ValueError as e:
        raise SystemExit(f"--spec wants steps,topk,draft_tokens[,min_prob]: {e}") from None
    if spec is None:
        raise SystemExit(f"--spec {text!r} is plain decoding: leave --draft out instead")
    return asdict(spec)


def start_code_server(target: str, draft: str | None, threads: int, spec: dict) -> tuple[subprocess.Popen, str]:
    """The server in its own process (its own GIL), started by ``serve(ServeConfig(...))``; returns once /health
    answers."""
    port = free_port()
    code = SERVER.format(threads=threads, target=target, draft=draft, port=port, spec=spec if draft else {})
    proc = subprocess.Popen([sys.executable, "-c", code])
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}")


def accept_totals(url: str) -> tuple[float, float]:
    """(sum, count) of the server's accept-length histogram."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    get = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # noqa: E731
    return get("eaglewire_accept_length_sum"), get("eaglewire_accept_length_count")


def latency_sample(client, model: str, prompt: str, max_tokens: int) -> Sample:
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


def latency_level(url: str, model: str, prompts: list[str], clients: int, requests: int,
                  max_tokens: int) -> dict[str, float]:
    """``clients`` threads, each sending ``requests`` streamed requests one after another."""
    from openai import OpenAI

    def worker(i: int) -> list[Sample]:
        c = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        return [latency_sample(c, model, prompts[(i * requests + j) % len(prompts)], max_tokens)
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


def latency(args: argparse.Namespace) -> int:
    from eaglewire.core.prompts import load_prompts

    levels = [int(x) for x in args.clients.split(",")]
    spec = spec_flags(args.spec)
    prompts = [p.text for p in load_prompts("mt-bench", 16)]
    print(f"{args.target}, server on CPU with {args.threads} threads, {args.requests} streamed requests per client, "
          f"max_tokens {args.max_tokens}, greedy" + (f", draft shape {args.spec}" if args.spec else "") + "\n")
    print("| draft | clients | TTFT p50 (s) | TTFT max (s) | per-token (ms) | throughput (tok/s) | accept length |")
    print("|---|---|---|---|---|---|---|")
    for draft in [None] + ([args.draft] if args.draft else []):
        proc, url = start_code_server(args.target, draft, args.threads, spec)
        try:
            for clients in levels:
                r = latency_level(url, args.target, prompts, clients, args.requests, args.max_tokens)
                print(f"| {draft or 'none'} | {clients} | {r['ttft_p50']:.2f} | {r['ttft_max']:.2f} | "
                      f"{r['per_token_ms']:.1f} | {r['throughput']:.1f} | {r['accept_length']:.2f} |", flush=True)
        finally:
            stop_server(proc)
    return 0


# ---------------------------------------------------------------- concurrency


def servers_of(drafts: dict[str, str], schedules: dict[str, str]) -> dict[str, list[str]]:
    """Server name -> serve flags: plain, then each draft's chain 1, chain 3 and schedule (where given); a draft
    other than the first is named after its label ("chain 1 new")."""
    out: dict[str, list[str]] = {"plain": []}
    for i, (label, draft) in enumerate(drafts.items()):
        suffix = "" if i == 0 else f" {label}"
        out[f"chain 1{suffix}"], out[f"chain 3{suffix}"] = chain(1, draft), chain(3, draft)
        if label in schedules:
            out[f"schedule{suffix}"] = chain(1, draft) + ["--schedule", schedules[label]]
    return out


def labelled(text: str | None) -> dict[str, str]:
    """"a=x,b=y" -> {a: x, b: y}; a bare "x" is labelled by itself."""
    pairs = [item.split("=", 1) if "=" in item else (item, item) for item in (text or "").split(",") if item]
    return {label.strip(): value.strip() for label, value in pairs}


def streamed_request(url: str, messages: list[dict], max_tokens: int) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    start = time.perf_counter()
    stamps, text, tokens = [], [], 0
    for chunk in client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
    ttft = stamps[0] - start if stamps else float("nan")
    gap = (stamps[-1] - stamps[0]) / max(tokens - 1, 1) if len(stamps) > 1 else float("nan")
    return dict(text="".join(text), tokens=tokens, ttft=ttft, per_token=gap)


def concurrency_level(url: str, prompts: list[list[dict]], clients: int, requests: int, max_tokens: int) -> dict:
    """``requests`` requests from ``clients`` clients at once -> aggregate figures and each request's text."""
    jobs = [prompts[i % len(prompts)] for i in range(requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(lambda m: streamed_request(url, m, max_tokens), jobs))
    wall = time.perf_counter() - start

    def pct(xs: list[float], q: int) -> float:
        xs = sorted(x for x in xs if x == x)
        return xs[min(len(xs) - 1, int(len(xs) * q / 100))] if xs else float("nan")

    ttft, gap = [d["ttft"] for d in done], [d["per_token"] for d in done]
    return dict(clients=clients, requests=requests, tokens=sum(d["tokens"] for d in done), seconds=round(wall, 2),
                tokens_per_s=round(sum(d["tokens"] for d in done) / wall, 1),
                ttft_p50=round(statistics.median(ttft), 3), ttft_p99=round(pct(ttft, 99), 3),
                per_token_p50_ms=round(1e3 * statistics.median(gap), 1), per_token_p99_ms=round(1e3 * pct(gap, 99), 1),
                texts=[d["text"] for d in done])


def concurrency(args: argparse.Namespace) -> int:
    from eaglewire.core.machine import summary_line
    from eaglewire.core.prompts import load_prompts

    prompts = [[{"role": "user", "content": p.text}] for p in load_prompts("mt-bench")[:16]]
    levels = [int(c) for c in args.concurrency.split(",")]
    drafts = labelled(args.drafts)
    schedules = {**labelled(args.schedules), **({next(iter(drafts)): args.schedule} if args.schedule else {})}
    servers = servers_of(drafts, schedules)
    chosen = list(servers) if args.servers == "all" else [s.strip() for s in args.servers.split(",")]
    result = {"machine": summary_line(), "max_tokens": args.max_tokens, "drafts": drafts, "servers": {}}
    print(result["machine"], flush=True)
    for name in [s for s in chosen if s in servers]:
        proc, url = start_cli_server(servers[name], args.threads,
                                     f"/tmp/serve_concurrency_{name.replace(' ', '_')}.log")
        try:
            concurrency_level(url, prompts, 1, 1, 8)  # warm-up
            rows = []
            for c in levels:
                row = concurrency_level(url, prompts, c, max(2 * c, args.min_requests), args.max_tokens)
                rows.append(row)
                print(f"{name:14} C={c:3} {row['tokens_per_s']:7.1f} tok/s  ttft p50 {row['ttft_p50']:.2f}s  "
                      f"per token p50 {row['per_token_p50_ms']:.1f} ms", flush=True)
            result["servers"][name] = rows
        finally:
            proc.terminate()
            proc.wait(30)
    plain = result["servers"].get("plain")
    if plain:
        for name, rows in result["servers"].items():
            for row, base in zip(rows, plain):
                n = min(len(row["texts"]), len(base["texts"]))
                row["same_as_plain"] = f"{sum(a == b for a, b in zip(row['texts'][:n], base['texts'][:n]))}/{n}"
                row["vs_plain"] = round(row["tokens_per_s"] / base["tokens_per_s"], 2)
        print(f"\n{'server':14} " + " ".join(f"{'C=' + str(c):>16}" for c in levels))
        for name, rows in result["servers"].items():
            print(f"{name:14} " + " ".join(f"{r['tokens_per_s']:7.1f} ({r['vs_plain']:.2f}x)" for r in rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


# ---------------------------------------------------------------- sustained


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def raw_request(host: str, port: int, body: dict, cancel_after: int | None) -> str:
    """-> an outcome: 'whole', 'cancelled', 'broken: ...' or 'status NNN'."""
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return f"status {resp.status}"
        if not body.get("stream"):
            answer = json.loads(resp.read())
            choice = answer["choices"][0]
            ok = choice["finish_reason"] in ("stop", "length") and answer["usage"]["completion_tokens"] >= 1
            return "whole" if ok else f"broken: {choice['finish_reason']}"
        chunks, finish = 0, None
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return "whole" if finish in ("stop", "length") else f"broken: stream ended without a finish ({finish})"
            event = json.loads(data)
            if "error" in event:
                return f"broken: error event {event['error'].get('code')}"
            if event["choices"] and event["choices"][0].get("finish_reason"):
                finish = event["choices"][0]["finish_reason"]
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                return "cancelled"  # the connection closes below, mid-stream
        return "broken: stream cut without [DONE]"
    finally:
        conn.close()


def sustained_client(host: str, port: int, prompts: list[str], deadline: float, seed: int, outcomes: Counter,
                     lock: threading.Lock) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        sampled, stream = rng.random() < 0.4, rng.random() < 0.5
        cancel_after = rng.randint(2, 8) if stream and rng.random() < 0.25 else None
        body = {"messages": [{"role": "user", "content": rng.choice(prompts)}], "max_tokens": rng.choice([16, 48, 96]),
                "temperature": 0.8 if sampled else 0.0, "stream": stream}
        if sampled:
            body["seed"] = rng.randrange(1 << 30)
        try:
            outcome = raw_request(host, port, body, cancel_after)
        except OSError as e:
            outcome = f"broken: {type(e).__name__}"
        with lock:
            outcomes[outcome] += 1


def sustained(args: argparse.Namespace) -> int:
    from eaglewire.core.machine import summary_line
    from eaglewire.core.prompts import load_prompts

    prompts = [p.text for p in load_prompts("mt-bench")]
    flags = SHAPES[args.server] + (["--schedule", args.schedule] if args.schedule else [])
    proc, url = start_cli_server(flags + ["--max-queue", str(2 * args.clients)], args.threads, "/tmp/serve_load.log")
    host, port = "127.0.0.1", int(url.rsplit(":", 1)[1])
    outcomes, lock = Counter(), threading.Lock()
    start = time.monotonic()
    deadline = start + args.seconds
    threads = [threading.Thread(target=sustained_client, args=(host, port, prompts, deadline, i, outcomes, lock),
                                daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    time.sleep(min(60, args.seconds / 2))
    rss_first = rss_mb(proc.pid)
    for t in threads:
        t.join()
    rss_end = rss_mb(proc.pid)
    metrics = http.client.HTTPConnection(host, port, timeout=30)
    metrics.request("GET", "/metrics")
    five_xx = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.getresponse().read().decode().splitlines()
                  if line.startswith("eaglewire_requests_total{") and 'status="5' in line)
    proc.terminate()
    proc.wait(60)
    result = {"machine": summary_line(), "clients": args.clients, "seconds": round(time.monotonic() - start, 1),
              "server": args.server, "schedule": args.schedule, "outcomes": dict(outcomes), "five_xx": five_xx,
              "rss_mb_after_first_minute": round(rss_first, 1), "rss_mb_end": round(rss_end, 1),
              "rss_ratio": round(rss_end / rss_first, 3)}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    broken = sum(n for k, n in outcomes.items() if k not in ("whole", "cancelled"))
    return 0 if broken == 0 and five_xx == 0 and abs(rss_end / rss_first - 1) <= 0.10 else 1


# ---------------------------------------------------------------- alone


def ask(host: str, port: int, body: dict) -> str | None:
    """The reply's text (None: its stream was closed early on purpose, or it failed)."""
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": False}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return json.loads(resp.read())["choices"][0]["message"]["content"] if resp.status == 200 else None
    finally:
        conn.close()


def alone(args: argparse.Namespace) -> int:
    from eaglewire.core.prompts import load_prompts

    prompts = [p.text for p in load_prompts("mt-bench")]
    rng = random.Random(0)
    bodies = []
    for i in range(args.requests):
        sampled = i % 3 == 2
        body = {"messages": [{"role": "user", "content": prompts[i % len(prompts)]}], "max_tokens": rng.choice([24, 64]),
                "temperature": 0.8 if sampled else 0.0}
        if sampled:
            body["seed"] = 1000 + i
        bodies.append((body, i % 2 == 1, i % 5 == 4))  # (body, streamed, closed after 3 chunks)
    flags = SHAPES[args.server] + (["--schedule", args.schedule] if args.schedule else [])
    proc, url = start_cli_server(flags, args.threads, "/tmp/serve_as_alone.log")
    host, port = "127.0.0.1", int(url.rsplit(":", 1)[1])
    try:
        def loaded(job):
            body, streamed, cancel = job
            if cancel:
                return raw_request(host, port, {**body, "stream": True}, 3), None
            if streamed:
                return raw_request(host, port, {**body, "stream": True}, None), None
            return "whole", ask(host, port, body)

        with ThreadPoolExecutor(args.clients) as pool:
            together = list(pool.map(loaded, bodies))
        counts = {"greedy": [0, 0], "sampled": [0, 0]}  # [equal to alone, compared]
        for (body, streamed, cancel), (outcome, text) in zip(bodies, together):
            assert outcome in ("whole", "cancelled"), outcome
            if text is None:
                continue
            kind = "greedy" if body["temperature"] == 0 else "sampled"
            again = ask(host, port, body)
            counts[kind][0] += again == text
            counts[kind][1] += 1
            if again != text:
                print(f"differs ({kind}, {body['max_tokens']} tokens):\n  {text!r}\n  {again!r}")
        outcomes = [o for o, _ in together]
        print(f"{args.clients} clients, {len(bodies)} requests ({outcomes.count('cancelled')} closed early, "
              f"{sum(s for _, s, c in bodies if not c)} streamed whole): equal to alone: greedy "
              f"{counts['greedy'][0]}/{counts['greedy'][1]}, seeded sampled {counts['sampled'][0]}/{counts['sampled'][1]}")
        return 0 if counts["greedy"][0] == counts["greedy"][1] else 1
    finally:
        proc.terminate()
        proc.wait(60)


# ---------------------------------------------------------------- command line


def parser() -> argparse.ArgumentParser:
    from eaglewire.core.presets import DEFAULT_TARGET

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)

    p = sub.add_parser("latency", help="TTFT, per-token latency, throughput and accept length per client count")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=None, help="also measure with this draft directory")
    p.add_argument("--spec", default=None, help="the draft shape: steps,topk,draft_tokens[,min_prob]")
    p.add_argument("--clients", default="1,4,8", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=4, help="requests per client per level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    p.set_defaults(run=latency)

    p = sub.add_parser("concurrency", help="plain, chain 1, chain 3 and tune's schedule at each concurrency")
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--drafts", default="reference",
                   help="drafts side by side, label=path comma-separated (the first is the unlabelled one)")
    p.add_argument("--schedule", help="a schedule from tune --concurrency for the first draft (adds 'schedule')")
    p.add_argument("--schedules", help="label=schedule.json for the other drafts (adds 'schedule LABEL')")
    p.add_argument("--servers", default="all", help="server names to run, comma-separated (default: all)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out")
    p.set_defaults(run=concurrency)

    p = one_server(sub, "sustained", "C clients for S seconds, mixed requests: no 5xx, replies whole, memory flat",
                   clients=32, run=sustained)
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--out")

    p = one_server(sub, "alone", "each reply under load equals the reply to that request alone", clients=8, run=alone)
    p.add_argument("--requests", type=int, default=24)
    return ap


def one_server(sub, name: str, help: str, *, clients: int, run) -> argparse.ArgumentParser:
    """A mode that loads one server: its clients, its shape (or a schedule) and its threads."""
    p = sub.add_parser(name, help=help)
    p.set_defaults(run=run)
    p.add_argument("--clients", type=int, default=clients)
    p.add_argument("--server", default="chain 1", choices=sorted(SHAPES))
    p.add_argument("--schedule")
    p.add_argument("--threads", type=int, default=2)
    return p


def main() -> int:
    args = parser().parse_args()
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
