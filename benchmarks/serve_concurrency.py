"""`eaglewire serve` under concurrent clients: aggregate tokens/s, time to first token and per-token latency at each
concurrency, plain beside a fixed speculative shape beside tune's schedule, outputs compared with plain's.

    OMP_NUM_THREADS=2 eaglewire tune --draft reference --concurrency 1,2,4,8,16 --schedule-out runs/schedule.json
    OMP_NUM_THREADS=2 python benchmarks/serve_concurrency.py --concurrency 1,2,4,8,16 \\
        --schedule runs/schedule.json --out runs/serve_concurrency.json

Two drafts side by side (each with its own schedule): ``--drafts reference,new=runs/regen/draft --schedules
new=runs/regen/schedule.json``.

Each server runs alone (started, measured at every concurrency, stopped), with the machine otherwise idle. Each
concurrency level sends ``max(2C, --min-requests)`` greedy chat requests of MT-bench prompts (C clients, each
streaming its requests one after another) and measures: completion tokens over the wall time (aggregate tokens/s),
time to first token and the mean gap between later tokens per request (p50 / p99).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from server_latency import free_port, wait_healthy  # noqa: E402

def chain(n: int, draft: str) -> list[str]:
    return ["--draft", draft, "--speculative-num-steps", str(n), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(n + 1)]


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


def start_server(args: list[str], threads: int, log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "eaglewire.cli", "--threads", str(threads), "serve", "--target", "smollm2-135m",
           "--port", str(port), "--max-batch", "16", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}", log_path)


def one_request(url: str, messages: list[dict], max_tokens: int) -> dict:
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


def level(url: str, prompts: list[list[dict]], clients: int, requests: int, max_tokens: int) -> dict:
    """``requests`` requests from ``clients`` clients at once -> aggregate figures and each request's text."""
    jobs = [prompts[i % len(prompts)] for i in range(requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(lambda m: one_request(url, m, max_tokens), jobs))
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--drafts", default="reference",
                    help="drafts side by side, label=path comma-separated (the first is the unlabelled one)")
    ap.add_argument("--schedule", help="a schedule from tune --concurrency for the first draft (adds 'schedule')")
    ap.add_argument("--schedules", help="label=schedule.json for the other drafts (adds 'schedule LABEL')")
    ap.add_argument("--servers", default="all", help="server names to run, comma-separated (default: all)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
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
        proc, url = start_server(servers[name], args.threads, f"/tmp/serve_concurrency_{name.replace(' ', '_')}.log")
        try:
            level(url, prompts, 1, 1, 8)  # warm-up
            rows = []
            for c in levels:
                row = level(url, prompts, c, max(2 * c, args.min_requests), args.max_tokens)
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


if __name__ == "__main__":
    raise SystemExit(main())
