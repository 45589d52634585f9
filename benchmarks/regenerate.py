"""Regeneration throughput: in-process batched regeneration vs llama-server on the same weights.

The same first ``--n`` ShareGPT first turns (one reply each, ``max_turns`` 1), ``--max-new-tokens``
greedy, run one after another on one machine with the threads pinned (``torch.set_num_threads``
here, ``-t``/``-tb`` for llama-server):

  in-process   ``eaglewire regenerate`` without a server (``data.regenerate``: the batched lean
               decoder), one row per ``--batch`` value
  llama-server ``eaglewire regenerate --server`` through llama-server (``data.remote_regenerate``,
               ``--concurrency`` = slots), one row per GGUF x ``--slots`` x ``--ubatch``

GGUFs: ``q4_1``, the preset's own file (the default target *is* this file dequantized, so these
are exactly its weights), ``f16`` (llama.cpp's converter from the dequantized weights, cached),
and ``q4_0`` when ``llama-quantize`` sits beside ``llama-server`` (quantized from the f16; skipped
with a note otherwise). ``--gguf NAME=PATH`` replaces the list.

reply tokens/s = the tokens of the written replies (re-tokenized by the target's tokenizer, so
both sides count alike; no stop token) over the wall time of the regeneration (llama-server's
start-up and the tokenizer probe excluded). ``same`` counts replies equal to the in-process
ones of the first batch row (greedy on other kernels and quantization differs where logits tie
or the weights differ). Prints a markdown table with each row's ratio to the best in-process row.

    python benchmarks/regenerate.py [--n 200] [--max-new-tokens 128] [--threads 2] [--batch 64]
        [--slots 1 8 16] [--ubatch 512] [--gguf NAME=PATH ...] [--out DIR]
    python benchmarks/regenerate.py --n 8 --batch 8 --slots 1 8     # a smoke check
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from eaglewire.core.presets import DATA_PRESETS, DEFAULT_TARGET, TARGET_PRESETS, data_path, fetch_asset
from eaglewire.data.conversations import Conversation, load_conversations
from eaglewire.data.regenerate import RegenerateConfig, regenerate
from eaglewire.data.remote_regenerate import RemoteConfig, regenerate_remote
from eaglewire.engines.llamacpp import (LlamaServer, find_tree, metrics, plain_server_config, require_server,
                                        target_architecture, target_gguf)
from eaglewire.model.target import load_target, resolve_target_path


def first_turns(n: int) -> list[Conversation]:
    conversations, _ = load_conversations(data_path("sharegpt"), limit=n)
    return conversations


def replies(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        out[record["id"]] = record["messages"][-1]["content"]
    return out


def reply_tokens(tokenizer, texts: dict[str, str]) -> int:
    return sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts.values())


def ggufs(args, server: Path) -> tuple[dict[str, Path], list[str]]:
    """The GGUFs to serve (name -> path) and notes on those that could not be made."""
    if args.gguf:
        return {k: Path(v) for k, v in (g.split("=", 1) for g in args.gguf)}, []
    found, notes = {"q4_1": fetch_asset(TARGET_PRESETS[DEFAULT_TARGET].asset)}, []
    tree = find_tree(args.llamacpp_dir)
    if tree is None:
        return found, ["f16 and q4_0 skipped: no llama.cpp source tree (converter) found"]
    target_dir = resolve_target_path(DEFAULT_TARGET)
    found["f16"] = target_gguf(target_dir, target_architecture(target_dir), "f16", tree=tree)
    quantize = server.parent / "llama-quantize"
    q4_0 = found["f16"].with_name(found["f16"].name.replace("-f16.gguf", "-q4_0.gguf"))
    if q4_0.is_file():
        found["q4_0"] = q4_0
    elif quantize.is_file():
        subprocess.run([str(quantize), str(found["f16"]), str(q4_0), "Q4_0", str(args.threads)], check=True,
                       stdout=subprocess.DEVNULL)
        found["q4_0"] = q4_0
    else:
        notes.append(f"q4_0 skipped: no {quantize} (build llama.cpp's llama-quantize target to add it)")
    return found, notes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200, help="ShareGPT first turns")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, nargs="+", default=[64], help="in-process batch sizes")
    p.add_argument("--slots", type=int, nargs="+", default=[1, 8, 16], help="llama-server -np values")
    p.add_argument("--ubatch", type=int, nargs="+", default=[512], help="llama-server -ub values")
    p.add_argument("--gguf", action="append", help="NAME=PATH of a GGUF to serve (repeatable)")
    p.add_argument("--llamacpp-dir", default=None)
    p.add_argument("--out", default=None, help="keep the regenerated JSONL files here")
    args = p.parse_args()
    assert "sharegpt" in DATA_PRESETS
    torch.set_num_threads(args.threads)
    out = Path(args.out or tempfile.mkdtemp(prefix="regen-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    conversations = first_turns(args.n)
    config = RegenerateConfig(max_new_tokens=args.max_new_tokens, max_turns=1)
    target = load_target(DEFAULT_TARGET, device="cpu", dtype="fp32")
    tok = target.tokenizer
    rows, reference = [], None

    for batch in args.batch:
        path = out / f"inprocess-b{batch}.jsonl"
        path.unlink(missing_ok=True)
        report = regenerate(target, conversations, path, config=RegenerateConfig(
            max_new_tokens=args.max_new_tokens, max_turns=1, batch_size=batch))
        texts = replies(path)
        reference = reference or texts
        rows.append(("in-process (fp32, dequantized Q4_1)", f"batch {batch}", reply_tokens(tok, texts),
                     report.seconds, sum(texts.get(k) == v for k, v in reference.items())))
        print(f"in-process batch {batch}: {report.summary()}", file=sys.stderr, flush=True)

    server = require_server(args.llamacpp_dir)
    files, notes = ggufs(args, server)
    breakdown = []
    ctx = config.max_prompt_tokens + config.max_new_tokens
    for name, gguf in files.items():
        for slots in args.slots:
            for ub in args.ubatch:
                path = out / f"llama-{name}-np{slots}-ub{ub}.jsonl"
                path.unlink(missing_ok=True)
                meta = path.with_name(path.name + ".meta.json")
                meta.unlink(missing_ok=True)
                launch = plain_server_config(gguf, slots=slots, threads=args.threads, ctx_per_slot=ctx,
                                             extra=["-ub", str(ub), "-b", str(max(ub, 2048))])
                with LlamaServer(server, launch) as running:
                    before = metrics(running.url) or {}  # the tokenizer probe's requests come before the run
                    report = regenerate_remote(conversations, path, tokenizer=tok, config=config,
                                               remote=RemoteConfig(concurrency=slots), urls=[running.url],
                                               target=DEFAULT_TARGET)
                    breakdown.append((name, slots, ub, report.seconds, counter_deltas(before, metrics(running.url) or {})))
                texts = replies(path)
                rows.append((f"llama-server {name}", f"-np {slots} -ub {ub}", reply_tokens(tok, texts),
                             report.seconds, sum(texts.get(k) == v for k, v in reference.items())))
                print(f"llama-server {name} -np {slots} -ub {ub}: {report.summary()}", file=sys.stderr, flush=True)

    best = max(tokens / seconds for label, _, tokens, seconds, _ in rows if label.startswith("in-process"))
    print(f"\n`{' '.join(shlex.quote(a) for a in sys.argv)}` — {len(conversations)} ShareGPT first turns, "
          f"{args.max_new_tokens} new tokens greedy, {args.threads} threads, {os.cpu_count()} cores\n")
    print("| engine | settings | reply tokens | seconds | reply tok/s | vs in-process | same replies |")
    print("|---|---|---|---|---|---|---|")
    for label, setting, tokens, seconds, same in rows:
        rate = tokens / seconds
        print(f"| {label} | {setting} | {tokens:,} | {seconds:.1f} | {rate:.1f} | {rate / best:.2f}x | "
              f"{same}/{len(reference)} |")
    print("\nWhere llama-server's time goes (its own counters over the run; prompt seconds are summed over "
          "the prompts, which run one batch at a time beside the slots' decoding):\n")
    print("| GGUF | settings | prompt tokens | prompt tok/s | prompt seconds / wall | reply tokens |")
    print("|---|---|---|---|---|---|")
    for name, slots, ub, wall, d in breakdown:
        prompt, seconds = d.get("prompt_tokens_total", 0), d.get("prompt_seconds_total", 0)
        print(f"| {name} | -np {slots} -ub {ub} | {prompt:,.0f} | {prompt / max(seconds, 1e-9):.0f} | "
              f"{seconds / wall:.2f} | {d.get('tokens_predicted_total', 0):,.0f} |")
    for note in notes:
        print(f"\n{note}")


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """llama-server's counters over one run (after - before)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


if __name__ == "__main__":
    main()
