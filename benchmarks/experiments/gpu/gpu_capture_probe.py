"""Capture throughput of `prepare` on a random-weight target: forward alone, the old capture+write path, the new one.

    python benchmarks/experiments/gpu/gpu_capture_probe.py --device cuda --shape llama-3.1-8b     # ~100k tokens, <= 90 s on an H200
    python benchmarks/experiments/gpu/gpu_capture_probe.py --device cpu --shape tiny              # a rehearsal

Builds a random LlamaForCausalLM of the shape directly on the device (bf16 on CUDA, fp32 on the CPU; vocab 49152),
makes random sequences of ShareGPT-like lengths (100-1500 tokens, a reply under the loss mask) and captures their
states at boundaries [2, L/2, L-3] into shards in a temp dir, three ways, each timed to the last shard on disk:

- forward: the target's decoder on the new path's batches, nothing kept (the ceiling);
- old: prepare's capture before issue 52: 8192-token batches sorted 64 conversations at a time, one
  ``ShardWriter.add`` per sequence (its checks and copies wait for the device), each shard concatenated,
  written by safetensors and read back for its sha256, all on the main thread;
- new: prepare's ``capture_plan``, ``capture_batch`` and ``WriterThread`` (what `prepare` runs).

Prints ONE JSON line (tok/s counts real tokens, padding aside): forward_tok_s, old_tok_s, new_tok_s,
bytes_per_token, the batches' padding share, seconds per variant, and errors per variant (a failed variant is
null, the others still run); the line is printed whatever happens.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: gpu_targets.py
from gpu_targets import SHAPES, VOCAB, random_target  # noqa: E402

DEFAULT_TOKENS = {"llama-3.1-8b": 100_000, "tiny": 20_000}
OLD_BATCH_TOKENS, OLD_WINDOW = 8192, 64  # prepare's before issue 52


def sequences(tokens: int, seed: int = 0):
    """Random conversations of ShareGPT-like lengths (log-normal around 500, within 100-1500) totalling ~tokens;
    the first ~30% of each is the prompt (no loss)."""
    import random

    from eaglewire.data.conversations import TokenizedConversation

    rng = random.Random(seed)
    out, total = [], 0
    while total < tokens:
        n = min(1500, max(100, int(rng.lognormvariate(math.log(500), 0.7))))
        prompt = max(1, int(n * rng.uniform(0.1, 0.5)))
        out.append(TokenizedConversation(id=str(len(out)), input_ids=[rng.randrange(VOCAB) for _ in range(n)],
                                         loss_mask=[0] * prompt + [1] * (n - prompt), num_assistant_turns=1,
                                         num_tokens_before_truncation=n))
        total += n
    return out


def padding_share(batches) -> float:
    real = sum(len(s.input_ids) for b in batches for s in b)
    padded = sum(len(b) * max(len(s.input_ids) for s in b) for b in batches)
    return round(1 - real / padded, 4)


def plan(seqs, batch_tokens: int, window: int):
    """prepare's batches: ``window`` conversations sorted together, packed to ``batch_tokens``."""
    from eaglewire.data.prepare import _chunks, batches_by_tokens

    return [b for chunk in _chunks(seqs, window) for b in batches_by_tokens(chunk, batch_tokens)]


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_forward(target, batches, device: str) -> None:
    import torch

    from eaglewire.data.sources import pad_right

    with torch.no_grad():
        for batch in batches:
            ids = pad_right([torch.tensor(s.input_ids) for s in batch], max(len(s.input_ids) for s in batch))
            target.decoder(input_ids=ids.to(device), use_cache=False)
    sync(device)


@contextmanager
def old_shard_files():
    """Shards written as before issue 52: concatenated, safetensors' save_file, read back for the sha256."""
    import torch
    from safetensors.torch import save_file as st_save_file

    import eaglewire.data.shards as shards

    def save_file(tensors, filename, metadata=None):
        st_save_file({k: torch.cat(list(v)) if not isinstance(v, torch.Tensor) else v for k, v in tensors.items()},
                     str(filename), metadata=metadata)
        return shards._sha256(Path(filename))

    real = shards.save_file
    shards.save_file = save_file
    try:
        yield
    finally:
        shards.save_file = real


def run_old(target, contract, batches, writer) -> None:
    """prepare's capture loop before issue 52: a padded batch, then one ``writer.add`` per sequence."""
    import torch

    from eaglewire.data.sources import pad_right
    from eaglewire.model.boundary_capture import capture

    for batch in batches:
        ids = pad_right([torch.tensor(s.input_ids) for s in batch], max(len(s.input_ids) for s in batch))  # [B, T]
        out = capture(target, ids, contract)
        for row, s in enumerate(batch):
            n = len(s.input_ids)
            writer.add(s.id, torch.tensor(s.input_ids, dtype=torch.int32), torch.tensor(s.loss_mask, dtype=torch.uint8),
                       out.aux_hidden[row, :n], out.last_hidden[row, :n])
    writer.close()


def run_new(target, contract, batches, writer) -> None:
    """What prepare runs now: staged batches, written on the writer thread."""
    from eaglewire.data.capture_writer import WriterThread
    from eaglewire.data.prepare import capture_batch

    with WriterThread() as background:
        for batch in batches:
            background.submit(partial(capture_batch(target, contract, batch, writer.storage).commit, writer))
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, default=None, help="tokens captured per variant (default: 100k, tiny 20k)")
    ap.add_argument("--variants", default="forward,old,new")
    ap.add_argument("--dir", default=None, help="where the shards go (default: a temp dir, removed)")
    args = ap.parse_args()
    result: dict = {"probe": "gpu_capture", "device": args.device, "shape": args.shape, "errors": {}, "seconds": {}}
    work = Path(tempfile.mkdtemp(prefix="capture-probe-", dir=args.dir))
    try:
        probe(args, result, work)
    except BaseException as e:  # noqa: BLE001 -- the line is printed whatever happens
        result["errors"]["setup"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        print(json.dumps(result), flush=True)


def probe(args, result: dict, work: Path) -> None:
    import torch

    from eaglewire.core.contract import HiddenStateContract
    from eaglewire.data.prepare import capture_plan
    from eaglewire.data.shards import ShardWriter

    torch.set_grad_enabled(False)
    start = time.perf_counter()
    target = random_target(args.shape, args.device)
    L = target.num_layers
    boundaries = (2, L // 2, L - 3)
    contract = HiddenStateContract(aux_boundaries=boundaries, target=target.fingerprint)
    seqs = sequences(args.tokens or DEFAULT_TOKENS[args.shape])
    tokens = sum(len(s.input_ids) for s in seqs)
    batch_tokens, window = capture_plan(None, 1500, target.device)
    new_batches, old_batches = plan(seqs, batch_tokens, window), plan(seqs, OLD_BATCH_TOKENS, OLD_WINDOW)
    result.update(gpu=torch.cuda.get_device_name(0) if args.device == "cuda" else None, dtype=str(target.dtype),
                  boundaries=list(boundaries), tokens=tokens, sequences=len(seqs),
                  batch_tokens={"old": OLD_BATCH_TOKENS, "new": batch_tokens},
                  batches={"old": len(old_batches), "new": len(new_batches)},
                  padding={"old": padding_share(old_batches), "new": padding_share(new_batches)})
    # warm-up (kernels, cuBLAS, the allocator), not timed
    run_forward(target, new_batches[:1], args.device)
    result["seconds"]["setup"] = round(time.perf_counter() - start, 2)

    def writer(name: str) -> ShardWriter:
        return ShardWriter(work / name, contract, source={"probe": name}, dtype="bf16")

    variants = {
        "forward": lambda: run_forward(target, new_batches, args.device),
        "old": lambda: _with(old_shard_files(), run_old, target, contract, old_batches, writer("old")),
        "new": lambda: run_new(target, contract, new_batches, writer("new")),
    }
    for name in args.variants.split(","):
        result[f"{name}_tok_s"] = None
        try:
            sync(args.device)
            t = time.perf_counter()
            variants[name]()
            sync(args.device)
            seconds = time.perf_counter() - t
            result["seconds"][name] = round(seconds, 2)
            result[f"{name}_tok_s"] = round(tokens / seconds)
            if name != "forward":
                size = sum(p.stat().st_size for p in (work / name).glob("*.safetensors"))
                result.setdefault("bytes_per_token", round(size / tokens, 1))
        except Exception as e:  # noqa: BLE001 -- one variant's failure is reported, the others still run
            result["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            shutil.rmtree(work / name, ignore_errors=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if result.get("old_tok_s") and result.get("new_tok_s"):
        result["speedup"] = round(result["new_tok_s"] / result["old_tok_s"], 2)
    if args.device == "cuda":
        result["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)


def _with(context, fn, *args):
    with context:
        return fn(*args)


if __name__ == "__main__":
    main()
