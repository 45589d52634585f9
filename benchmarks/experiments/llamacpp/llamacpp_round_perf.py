"""Where a llama.cpp EAGLE-3 round's time goes, from `perf` call stacks of llama-server's main thread.

The main thread runs the slot loop and takes part in every ggml graph (OpenMP's thread 0), so
its samples split a round by the caller on the stack: the target's verify decode, the draft's
context update (`process`: encoder + decode of the verified rows), the draft's own steps
(`draft`), sampling, and the rest; and inside each, by the kernel at the leaf (matmuls, flash
attention, OpenMP waits). Run alone on the machine:

    python benchmarks/experiments/llamacpp/llamacpp_round_perf.py --target T.gguf --draft D.gguf --n-max 1 [--plain]

Needs `perf` with DWARF unwinding. Prints a markdown table of ms per round (or per token, plain).
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eaglewire.engines.llamacpp import LlamaServer, chain_config, complete, require_server
from eaglewire.core.prompts import load_prompts
from eaglewire.model.target import load_tokenizer
from eaglewire.decode.text import encode_prompt
from eaglewire.engines.interface import Shape
from eaglewire.engines.llamacpp.runtime import RunningLlamaServer

# callers, outermost role first: a draft step's decode is still the draft's
CALLERS = [("draft steps (draft())", ("eagle3::draft",)),
           ("draft context update (process(): encoder + decode of the verified rows)", ("eagle3::process",)),
           ("sampling", ("common_sampler",)),
           ("target verify decode", ("llama_decode", "llama_context::decode"))]


def short(symbol: str) -> str:
    """A kernel's name without its template arguments and offsets."""
    symbol = symbol.split("+0x")[0]
    if "tinyBLAS" in symbol:
        kind = "q8_0" if "block_q8_0" in symbol else "f16" if "fp16" in symbol else "f32"
        return f"tinyBLAS {kind} gemm"
    return symbol.split("<")[0].split("(")[0].strip() or "?"


def classify(frames: list[str]) -> tuple[str, str]:
    """frames innermost first -> (caller role, leaf kernel)."""
    caller = "other (server loop, waits)"
    for name, markers in CALLERS:
        if any(m in f for f in frames for m in markers):
            caller = name
            break
    leaf = short(frames[0]) if frames else "?"
    if any(x in leaf for x in ("gomp", "GOMP")) or (leaf == "[unknown]" and any("libgomp" in f for f in frames)):
        leaf = "OpenMP wait"
    return caller, leaf


def parse_perf_script(text: str, tid: int) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for block in text.split("\n\n"):
        lines = [ln for ln in block.splitlines() if ln.strip()]
        if not lines:
            continue
        head = lines[0].split()
        try:
            sample_tid = int(head[1].split("/")[-1]) if "/" in head[1] else int(head[1])
        except (IndexError, ValueError):
            continue
        if sample_tid != tid:
            continue
        frames = []
        for ln in lines[1:]:
            parts = ln.strip().split(None, 1)
            frames.append(parts[1] if len(parts) > 1 else parts[0])
        counts[classify(frames)] += 1
    return counts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--n-max", type=int, default=1)
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--freq", type=int, default=1000)
    ap.add_argument("--tokenizer", default="smollm2-135m")
    args = ap.parse_args()

    tok = load_tokenizer(args.tokenizer)
    prompts = [encode_prompt(tok, p.text, chat=p.chat) for p in load_prompts("mt-bench")[40:40 + args.prompts]]
    config = chain_config(Path(args.target), args.draft and Path(args.draft), threads=args.threads,
                          n_max=0 if args.plain else args.n_max, extra=["-lv", "4"])
    with tempfile.TemporaryDirectory() as tmp, LlamaServer(require_server(), config) as server:
        complete(server.url, prompts[0], n_predict=32)
        running = RunningLlamaServer(server, Shape(0 if args.plain else args.n_max))
        running.requests = 1
        before = running.draft_totals()
        data = Path(tmp) / "perf.data"
        perf = subprocess.Popen(["perf", "record", "--call-graph", "dwarf,65528", "-F", str(args.freq), "-p",
                                 str(server._proc.pid), "-o", str(data)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        answers = [complete(server.url, ids, n_predict=args.tokens) for ids in prompts]
        perf.send_signal(2)
        perf.wait()
        running.requests = 1 + len(prompts)
        after = running.draft_totals()
        script = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,tid,ip,sym,dso"],
                                capture_output=True, text=True).stdout
        pid = server._proc.pid
    counts = parse_perf_script(script, pid)
    total = sum(counts.values())
    gen_ms = sum(a["timings"]["predicted_ms"] for a in answers)
    tokens = sum(a["timings"]["predicted_n"] for a in answers)
    rounds = tokens if args.plain else after.rounds - before.rounds
    per = "token" if args.plain else "round"
    unit_ms = gen_ms / (tokens if args.plain else max(rounds, 1))
    print(f"{'plain' if args.plain else f'n-max {args.n_max}'}: {tokens} tokens in {gen_ms:.0f} ms, "
          f"{gen_ms / tokens:.2f} ms/token, {rounds} rounds, {unit_ms:.2f} ms per {per}; main-thread samples {total}")
    by_caller: collections.Counter = collections.Counter()
    for (caller, _), n in counts.items():
        by_caller[caller] += n
    print(f"\n| where (main thread, caller on the stack) | share | ms per {per} | top kernels (share of all) |\n|---|---|---|---|")
    for caller, n in by_caller.most_common():
        leaves = sorted(((leaf, k) for (c, leaf), k in counts.items() if c == caller), key=lambda x: -x[1])[:4]
        tops = ", ".join(f"{leaf} {k / total:.1%}" for leaf, k in leaves)
        print(f"| {caller} | {n / total:.1%} | {n / total * unit_ms:.2f} | {tops} |")
    print(json.dumps({"tokens": tokens, "gen_ms": gen_ms, "counts": {f"{c}/{l}": n for (c, l), n in counts.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
