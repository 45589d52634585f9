"""The capture's writer alone: shards of an 8B target's states written, hashed and made durable, MB/s.

On a GPU the forward computes an 8B target's states faster than one thread writes them (an H200: forward 30.4k
tok/s, capture with states written 13.4k at 32.8 KB a token). This measures the writer's side of that on any
machine, with no target: synthetic bf16 states of Llama-3.1-8B's shape (3 aux boundaries of 4,096 + the last
state: 32,776 bytes a token with ids and mask) handed to ``ShardWriter.add_encoded`` in 16,384-token batches as
``prepare``'s writer thread hands them, into 65,536-token shards (2.1 GB each: sha256, fsync, manifest), three
ways side by side, alternating:

- inline: the sha256 computed on the writing thread between writes, the whole file flushed by the fsync (the
  shard file before this benchmark);
- beside: the sha256 on a thread of its own while the writes go on;
- beside + writeback: also the disk's writeback started after each chunk (``shard_file.save_file``).

    python benchmarks/experiments/data/shard_write.py --dir /tmp/shard-write --shards 2 --repeats 3

Prints one table row per variant (median of the repeats) and the machine's own ceilings: sha256 and write+fsync
of one 1 GiB buffer.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "src"))

H, K, BATCH, SHARD = 4096, 3, 16384, 65536  # Llama-3.1-8B's hidden size, aux boundaries; prepare's sizes on CUDA


def contract():
    from eaglewire.core.contract import HiddenStateContract, TargetFingerprint

    fingerprint = TargetFingerprint(architecture="LlamaForCausalLM", num_layers=32, hidden_size=H, vocab_size=49152,
                                    tokenizer_sha256="synthetic", chat_template_sha256="synthetic",
                                    weights_sha256="synthetic", dtype="bfloat16")
    return HiddenStateContract(aux_boundaries=(2, 16, 29), target=fingerprint)


def batch(seed: int) -> dict[str, torch.Tensor]:
    """One 16,384-token batch as the capture hands it over: 32 sequences of 512 tokens."""
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 49152, (BATCH,), generator=g, dtype=torch.int32),
            "loss_mask": torch.ones(BATCH, dtype=torch.uint8),
            "aux_hidden": torch.randn(BATCH, K * H, generator=g).bfloat16(),  # [N, k*H]
            "last_hidden": torch.randn(BATCH, H, generator=g).bfloat16()}  # [N, H]


class InlineHasher:
    """``shard_file._Hasher``'s interface, hashing on the caller's thread: the writer before this benchmark."""

    def __init__(self, first: bytes) -> None:
        self._digest = hashlib.sha256(first)

    def update(self, buf) -> None:
        self._digest.update(buf)

    def close(self) -> None:
        pass

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def no_writeback():
    """``save_file`` leaving the whole file's writeback to the fsync."""
    import eaglewire.data.shard_file as shard_file

    return mock.patch.object(shard_file, "_START_WRITEBACK", None)


@contextmanager
def inline_hash():
    """``save_file`` with the sha256 computed between the writes, on the writing thread, no writeback started."""
    import eaglewire.data.shard_file as shard_file

    with no_writeback(), mock.patch.object(shard_file, "_Hasher", InlineHasher):
        yield


def write(out: Path, batches: list[dict[str, torch.Tensor]], shards: int) -> float:
    """Seconds to write ``shards`` full shards through ShardWriter.add_encoded, fsyncs included."""
    from eaglewire.data.shards import ShardWriter

    writer = ShardWriter(out, contract(), source={"benchmark": "shard_write"}, dtype="bf16", shard_tokens=SHARD)
    checks = torch.zeros(BATCH, 6)
    start = time.perf_counter()
    for i in range(shards * SHARD // BATCH):
        b = batches[i % len(batches)]
        ids = [f"{i}-{j}" for j in range(32)]
        writer.add_encoded(ids, [512] * 32, b["input_ids"], b["loss_mask"],
                           {"aux_hidden": b["aux_hidden"], "last_hidden": b["last_hidden"]}, checks)
    writer.close()
    return time.perf_counter() - start


def ceilings(work: Path) -> dict[str, float]:
    """The machine's sha256 and write+fsync rates on one 1 GiB buffer, MB/s."""
    buf = torch.randint(0, 255, (2**30,), dtype=torch.uint8).numpy()
    t = time.perf_counter()
    hashlib.sha256(buf).hexdigest()
    sha = 2**30 / (time.perf_counter() - t) / 1e6
    path = work / "ceiling.bin"
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.write(buf)
        f.flush()
        written = time.perf_counter() - t
        os.fsync(f.fileno())
    durable = time.perf_counter() - t
    path.unlink()
    return {"sha256": sha, "write": 2**30 / written / 1e6, "write+fsync": 2**30 / durable / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where the shards go (a scratch folder on the disk to measure)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    batches = [batch(seed) for seed in range(2)]
    per_token = sum(x[0].numel() * x.element_size() for x in batches[0].values()) + 8  # + the offsets, about
    tokens = args.shards * SHARD
    variants = {"inline": inline_hash, "beside": no_writeback, "beside + writeback": nullcontext}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(args.repeats):
        for name, context in variants.items():  # alternating: the disk's state drifts between runs
            out = work / f"run-{rep}"
            with context():
                seconds[name].append(write(out, batches, args.shards))
            shutil.rmtree(out)
    ceiling = ceilings(work)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"{cpu}; {tokens:,} tokens a run ({args.shards} shards of {SHARD:,}), {per_token:,} bytes a token, "
          f"median of {args.repeats}")
    print("| sha256, writeback | MB/s | tokens/s | vs inline | seconds (each run) |\n|---|---|---|---|---|")
    base = statistics.median(seconds["inline"])
    for name, runs in seconds.items():
        s = statistics.median(runs)
        print(f"| {name} | {tokens * per_token / s / 1e6:,.0f} | {tokens / s:,.0f} | {base / s:.2f}x | "
              f"{', '.join(f'{r:.1f}' for r in runs)} |")
    print(f"ceilings, one 1 GiB buffer: sha256 {ceiling['sha256']:,.0f} MB/s, write {ceiling['write']:,.0f} MB/s, "
          f"write+fsync {ceiling['write+fsync']:,.0f} MB/s")


if __name__ == "__main__":
    main()
