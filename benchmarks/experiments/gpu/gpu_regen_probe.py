"""Batched regeneration speed, grouped eager path vs the fixed-shape step (a CUDA graph on a GPU), one JSON line.

Builds a random-weight LlamaForCausalLM of ``--shape`` directly on ``--device`` (bf16 on CUDA, fp32 on a CPU;
vocabulary 49,152 like SmolLM2's tokenizer), wraps it in eaglewire's Target and runs ``BatchedDecoder`` on
``--batch`` random prompts of 40-300 tokens, greedy, with no stop token (every row runs every step):

- ``new``: mode graph on CUDA (static on a CPU: the same step, eager), ``--new-tokens`` per row, called twice:
  the first call captures the graph (``first_call_s``), the second is the one timed;
- ``static_eager`` (CUDA only): the same step without the graph, whose tokens the graph must equal exactly;
- ``grouped``: the previous default, per-group attention and compaction; when a short call says the full run
  would not fit ``--budget-s``, it runs fewer new tokens (``new_tokens`` says how many) and is compared on those.

Per variant: tok/s (new tokens over the whole call, prefill included), prefill_s, ms per decode step, or the error
that stopped it; then whether the outputs match (``graph_vs_eager`` must; ``new_vs_grouped`` in bf16 may part on a
near-tie). Always one JSON line on stdout, last; progress on stderr; exit 1 if anything failed.

    python benchmarks/experiments/gpu/gpu_regen_probe.py --device cuda --shape llama-3.1-8b     # <= 90 s on an H200
    python benchmarks/experiments/gpu/gpu_regen_probe.py --device cpu --shape tiny              # rehearsal
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: gpu_targets.py
from gpu_targets import SHAPES, VOCAB, random_target  # noqa: E402

log = logging.getLogger("gpu_regen_probe")


def make_prompts(batch: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (batch,), generator=gen).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_call(decoder, prompts, new_tokens: int, device: str) -> tuple[list, float]:
    sync(device)
    start = time.perf_counter()
    out = decoder.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])
    sync(device)
    return out, time.perf_counter() - start


def measure(decoder, prompts, new_tokens: int, device: str, *, warm_tokens: int = 0) -> tuple[dict, list]:
    """One variant: an optional first call (capture, kernel warm-up), then the timed call. The prefill's time is
    the static step's own (it waits for the first tokens); the grouped path's does not wait on a GPU, so there it
    is a call of one new token's."""
    row: dict = {}
    if warm_tokens:
        _, first = timed_call(decoder, prompts, warm_tokens, device)
        row["first_call_s"] = round(first, 3)
    out, seconds = timed_call(decoder, prompts, new_tokens, device)
    row["mode"] = mode = decoder.stats.mode
    prefill = decoder.stats.prefill_seconds if mode != "grouped" else timed_call(decoder, prompts, 1, device)[1]
    row.update(new_tokens=new_tokens, seconds=round(seconds, 3),
               tok_s=round(len(prompts) * new_tokens / seconds, 1), prefill_s=round(prefill, 3),
               ms_per_step=round(1000 * (seconds - prefill) / max(new_tokens - 1, 1), 2))
    return row, out


def compare(a: list, b: list) -> dict:
    """Greedy replies of two variants over the tokens both made: rows equal, mean common prefix."""
    n = min(len(a[0][0]), len(b[0][0]))
    rows = [(x[:n], y[:n]) for (x, _), (y, _) in zip(a, b)]
    prefix = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), n) for x, y in rows]
    return {"match": all(x == y for x, y in rows), "rows_equal": sum(x == y for x, y in rows), "tokens": n,
            "mean_common_prefix": round(sum(prefix) / len(prefix), 1)}


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run(args, result: dict, wall: float) -> None:
    from eaglewire.decode.batched import BatchedDecoder

    start = time.perf_counter()
    target = random_target(args.shape, args.device)
    sync(args.device)
    result["build_s"] = round(time.perf_counter() - start, 2)
    prompts = make_prompts(args.batch, 40, 300)
    result["prompt_tokens"] = sum(map(len, prompts))
    cuda = args.device.startswith("cuda")
    outs: dict[str, list] = {}
    variants = [("new", "graph" if cuda else "static", True)]
    if cuda:
        variants.append(("static_eager", "static", False))
    variants.append(("grouped", "grouped", False))
    for name, mode, warm in variants:
        try:
            decoder = BatchedDecoder(target, mode=mode)
            new_tokens = args.new_tokens
            if name == "grouped":  # the slow one: fit what is left of the budget
                _, probe = timed_call(decoder, prompts, 8, args.device)
                left = args.budget_s - (time.perf_counter() - wall) - 5
                per_token = probe / 8
                new_tokens = max(8, min(args.new_tokens, int(left / (2 * per_token))))  # prefill call + timed call
            result[name], outs[name] = measure(decoder, prompts, new_tokens, args.device,
                                               warm_tokens=args.new_tokens if warm else 0)
        except Exception as exc:  # report it and go on to the next variant
            traceback.print_exc(file=sys.stderr)
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        finally:
            decoder = None
            free(args.device)
        log.info("%s: %s", name, result[name])
    if "new" in outs and "grouped" in outs:
        result["new_vs_grouped"] = compare(outs["new"], outs["grouped"])
    if "new" in outs and "static_eager" in outs:
        result["graph_vs_eager"] = compare(outs["new"], outs["static_eager"])
    if cuda:
        result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=85.0, help="the grouped path runs fewer tokens to fit this")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    wall = time.perf_counter()
    result: dict = {"device": args.device, "shape": args.shape, "batch": args.batch, "new_tokens": args.new_tokens,
                    "torch": torch.__version__}
    try:
        if args.device == "cuda":
            result["gpu"] = torch.cuda.get_device_name()
        run(args, result, wall)
    except BaseException as exc:  # noqa: BLE001 -- the JSON line must come out whatever happened
        traceback.print_exc(file=sys.stderr)
        result["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        result["wall_s"] = round(time.perf_counter() - wall, 1)
        print(json.dumps(result), flush=True)
    failed = "error" in result or any(isinstance(v, dict) and "error" in v for v in result.values())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
