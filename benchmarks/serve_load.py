"""`eaglewire serve` under sustained load: C clients for S seconds on loopback, mixed greedy and sampled requests,
some streamed, some cancelled mid-stream; no 5xx, every reply whole or cleanly cancelled, the server's memory flat.

    OMP_NUM_THREADS=2 python benchmarks/serve_load.py --clients 32 --seconds 300 --out runs/serve_load.json
    OMP_NUM_THREADS=2 python benchmarks/serve_load.py --schedule runs/schedule.json ...   # with tune's schedule

A whole reply: a non-streamed answer with a finish reason and as many tokens as its usage says, or a stream whose
chunks end with a finish reason and ``data: [DONE]``. Memory: the server's resident size one minute in and at the
end (the first minute fills the caches every batch size needs), and their ratio.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_concurrency import SHAPES, start_server  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one_request(host: str, port: int, body: dict, cancel_after: int | None) -> str:
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


def client(host: str, port: int, prompts: list[str], deadline: float, seed: int, outcomes: Counter,
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
            outcome = one_request(host, port, body, cancel_after)
        except OSError as e:
            outcome = f"broken: {type(e).__name__}"
        with lock:
            outcomes[outcome] += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--server", default="chain 1", choices=sorted(SHAPES))
    ap.add_argument("--schedule")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    from eaglewire.core.machine import summary_line
    from eaglewire.core.prompts import load_prompts

    prompts = [p.text for p in load_prompts("mt-bench")]
    flags = SHAPES[args.server] + (["--schedule", args.schedule] if args.schedule else [])
    proc, url = start_server(flags + ["--max-queue", str(2 * args.clients)], args.threads, "/tmp/serve_load.log")
    host, port = "127.0.0.1", int(url.rsplit(":", 1)[1])
    outcomes, lock = Counter(), threading.Lock()
    start = time.monotonic()
    deadline = start + args.seconds
    threads = [threading.Thread(target=client, args=(host, port, prompts, deadline, i, outcomes, lock), daemon=True)
               for i in range(args.clients)]
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


if __name__ == "__main__":
    raise SystemExit(main())
