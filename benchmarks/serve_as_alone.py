"""Each reply a loaded server gives equals the reply it gives that request alone: C clients at once (greedy and
seeded-sampled, streamed and whole, some streams closed early), then every whole reply's request again, one at a
time. Greedy replies must be equal; a seeded sampled one repeats only where the same kind of step (plain or
speculative) produced it, since a speculative round draws its random numbers otherwise than a plain step does (the
distribution is the target's either way): with a schedule that switches by load, it may not.

    OMP_NUM_THREADS=2 python benchmarks/serve_as_alone.py --clients 8 --schedule runs/schedule.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_concurrency import SHAPES, start_server  # noqa: E402
from serve_load import one_request  # noqa: E402


def ask(host: str, port: int, body: dict) -> str | None:
    """The reply's text (None: its stream was closed early on purpose, or it failed)."""
    import http.client

    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": False}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return json.loads(resp.read())["choices"][0]["message"]["content"] if resp.status == 200 else None
    finally:
        conn.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--server", default="chain 1", choices=sorted(SHAPES))
    ap.add_argument("--schedule")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
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
    proc, url = start_server(flags, args.threads, "/tmp/serve_as_alone.log")
    host, port = "127.0.0.1", int(url.rsplit(":", 1)[1])
    try:
        def loaded(job):
            body, streamed, cancel = job
            if cancel:
                return one_request(host, port, {**body, "stream": True}, 3), None
            if streamed:
                return one_request(host, port, {**body, "stream": True}, None), None
            return "whole", ask(host, port, body)

        with ThreadPoolExecutor(args.clients) as pool:
            together = list(pool.map(loaded, bodies))
        counts = {"greedy": [0, 0], "sampled": [0, 0]}  # [equal to alone, compared]
        for (body, streamed, cancel), (outcome, text) in zip(bodies, together):
            assert outcome in ("whole", "cancelled"), outcome
            if text is None:
                continue
            kind = "greedy" if body["temperature"] == 0 else "sampled"
            alone = ask(host, port, body)
            counts[kind][0] += alone == text
            counts[kind][1] += 1
            if alone != text:
                print(f"differs ({kind}, {body['max_tokens']} tokens):\n  {text!r}\n  {alone!r}")
        outcomes = [o for o, _ in together]
        print(f"{args.clients} clients, {len(bodies)} requests ({outcomes.count('cancelled')} closed early, "
              f"{sum(s for _, s, c in bodies if not c)} streamed whole): equal to alone: greedy "
              f"{counts['greedy'][0]}/{counts['greedy'][1]}, seeded sampled {counts['sampled'][0]}/{counts['sampled'][1]}")
        return 0 if counts["greedy"][0] == counts["greedy"][1] else 1
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    raise SystemExit(main())
