"""Drafts trained on replies regenerated in process and by llama-server: held-out acc@0, one recipe.

    # the full run (issue 28: "held-out acc@0 of drafts trained on each set with one recipe")
    nice -n 10 python benchmarks/experiments/data/regenerated_data.py --out /tmp/regen-data --n 200 --heldout 50 \
        --steps 300 --sets inprocess q4_0 f16 --heldout-from inprocess q4_0 --reuse /tmp/regen-bench3
    # a smoke run (a few conversations and steps, about two minutes on 2 cores)
    python benchmarks/experiments/data/regenerated_data.py --out /tmp/regen-data-smoke --n 4 --heldout 2 --max-new-tokens 16 \
        --steps 3 --ttt-steps 2 --max-length 192 --slots 2

The same first ``--n`` ShareGPT first turns (one reply each, greedy, ``--max-new-tokens``) get their
replies from each of ``--sets``:

  inprocess  the default target (the preset's Q4_1 GGUF dequantized, fp32) in this process, batched
             (``eaglewire regenerate`` without a server)
  q4_0, f16  llama-server on that GGUF (``eaglewire regenerate --llamacpp-gguf``: the GGUFs of
             ``benchmarks/regenerate.py``), ``--slots`` slots

``--reuse DIR`` takes the JSONL files ``benchmarks/regenerate.py --out DIR`` left
(``inprocess-b*.jsonl``, ``llama-{set}-*.jsonl``; made with the same ``--max-new-tokens``: that is
not checked) as a start: they are copied and the run resumes them, so only missing conversations
are asked. Every set is cut to the conversations all sets answered (same prompts, in the same
order), prepared with the same settings (bf16 + last state, ``--max-length``) and trained with one
recipe (``--steps``, ``--lr``, ``--batch-tokens``, ``--ttt-steps``, seed 0: the same split and
order). Each draft's held-out acc@0 (the TTT unroll's step 0 against the target head's argmax on
the stored states, as ``doctor --stored`` measures, ``compact_states.measure``) is taken on the
next ``--heldout`` ShareGPT first turns with replies from each of ``--heldout-from`` (default: the
in-process target's own; ``q4_0``: the replies a llama.cpp deployment of the Q4_0 file writes).
The held-out states are always the in-process target's capture: only the reply text differs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: regenerate.py
import compact_states  # noqa: E402  (the held-out acc@0 measurement)
import regenerate as speed_bench  # noqa: E402  (first turns, replies, the GGUFs)

from eaglewire.core.presets import DEFAULT_TARGET, data_path  # noqa: E402
from eaglewire.data.conversations import load_conversations  # noqa: E402
from eaglewire.data.prepare import PrepareConfig, prepare  # noqa: E402
from eaglewire.data.regenerate import RegenerateConfig, regenerate  # noqa: E402
from eaglewire.data.remote_regenerate import RemoteConfig, meta_path, regenerate_remote, server_urls  # noqa: E402
from eaglewire.data.shards import ShardDataset  # noqa: E402
from eaglewire.engines.llamacpp import require_server  # noqa: E402
from eaglewire.model.target import load_target  # noqa: E402
from eaglewire.train.loop import train  # noqa: E402
from eaglewire.train.train_config import TrainConfig  # noqa: E402

INPROCESS = "inprocess"


def args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=200, help="ShareGPT first turns to train on")
    p.add_argument("--heldout", type=int, default=50, help="the next first turns, held out")
    p.add_argument("--sets", nargs="+", default=[INPROCESS, "q4_0"], help="inprocess and GGUF names (q4_0, f16, q4_1)")
    p.add_argument("--heldout-from", nargs="+", default=[INPROCESS], help="whose replies the held-out set holds")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=64, help="in-process rows regenerated together")
    p.add_argument("--slots", type=int, default=16, help="llama-server -np")
    p.add_argument("--reuse", default=None, help="a benchmarks/regenerate.py --out directory to start from")
    p.add_argument("--gguf", action="append", help="NAME=PATH of a GGUF (repeatable; default: regenerate.py's)")
    p.add_argument("--llamacpp-dir", default=None)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-4)
    return p.parse_args()


def reused(reuse: str | None, name: str) -> Path | None:
    """The JSONL ``benchmarks/regenerate.py`` left for set ``name`` in ``reuse`` (the most complete one)."""
    if not reuse:
        return None
    pattern = "inprocess-b*.jsonl" if name == INPROCESS else f"llama-{name}-*.jsonl"
    found = sorted(Path(reuse).glob(pattern), key=lambda f: -len(f.read_text().splitlines()))
    return found[0] if found else None


def replies_of(name: str, conversations, path: Path, a, target, ggufs: dict[str, Path]) -> Path:
    """``path`` holding set ``name``'s replies to ``conversations`` (resumed: only missing ones are asked)."""
    config = RegenerateConfig(max_new_tokens=a.max_new_tokens, max_turns=1, batch_size=a.batch)
    if name == INPROCESS:
        regenerate(target, conversations, path, config=config)
        return path
    if name not in ggufs:
        raise SystemExit(f"--sets {name}: no such GGUF (have {', '.join(ggufs)}; add --gguf {name}=PATH)")
    remote = RemoteConfig(llamacpp_gguf=str(ggufs[name]), slots=a.slots, concurrency=a.slots,
                          server_threads=a.threads, llamacpp_dir=a.llamacpp_dir)
    with server_urls(remote, ctx_per_slot=config.max_prompt_tokens + config.max_new_tokens) as urls:
        regenerate_remote(conversations, path, tokenizer=target.tokenizer, config=config, remote=remote, urls=urls,
                          target=DEFAULT_TARGET)
    return path


def start_from(source: Path | None, path: Path) -> None:
    """Copy a reused JSONL (and its sidecar) to ``path`` once, so the run resumes it."""
    if source is None or path.exists():
        return
    shutil.copyfile(source, path)
    if meta_path(source).is_file():
        shutil.copyfile(meta_path(source), meta_path(path))


def cut_to(path: Path, ids: list[str], into: Path) -> Path:
    """``path``'s records of ``ids``, in that order (its sidecar beside, so prepare records how they were made)."""
    records = {json.loads(line)["id"]: line for line in path.read_text().splitlines() if line.strip()}
    into.write_text("".join(records[i] + "\n" for i in ids))
    if meta_path(path).is_file():
        shutil.copyfile(meta_path(path), meta_path(into))
    return into


def main() -> int:
    a = args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    torch.set_num_threads(a.threads)
    target = load_target(DEFAULT_TARGET, device="cpu", dtype="fp32")
    needs_server = any(s != INPROCESS for s in a.sets + a.heldout_from)
    ggufs = speed_bench.ggufs(argparse.Namespace(gguf=a.gguf, llamacpp_dir=a.llamacpp_dir, threads=a.threads),
                              require_server(a.llamacpp_dir))[0] if needs_server else {}
    train_convs = speed_bench.first_turns(a.n)
    heldout_convs, _ = load_conversations(data_path("sharegpt"), limit=a.heldout, offset=a.n)

    made = {}
    for name in a.sets:
        path = out / f"replies-{name}.jsonl"
        start_from(reused(a.reuse, name), path)
        made[name] = replies_of(name, train_convs, path, a, target, ggufs)
        print(f"{name}: {len(made[name].read_text().splitlines())} replies", file=sys.stderr, flush=True)
    answered = [set(speed_bench.replies(p)) for p in made.values()]
    common = [c.id for c in train_convs if all(c.id in s for s in answered)]

    prep = dict(target=DEFAULT_TARGET, max_length=a.max_length, batch_tokens=max(4096, a.max_length), device="cpu")
    heldout = {}
    for name in a.heldout_from:
        path = replies_of(name, heldout_convs, out / f"heldout-replies-{name}.jsonl", a, target, ggufs)
        ids = list(speed_bench.replies(path))
        shards = out / f"heldout-{name}"
        prepare(PrepareConfig(out=str(shards), data=str(cut_to(path, ids, out / f"heldout-{name}.jsonl")), **prep),
                target=target, progress=False)
        heldout[name] = ShardDataset(shards)

    rows = {}
    for name, path in made.items():
        shards, draft = out / f"shards-{name}", out / f"draft-{name}"
        prepare(PrepareConfig(out=str(shards), data=str(cut_to(path, common, out / f"train-{name}.jsonl")), **prep),
                target=target, progress=False)
        ds = ShardDataset(shards)
        train(TrainConfig(out=str(draft), target=DEFAULT_TARGET, data=str(shards), max_steps=a.steps,
                          epochs=a.steps,  # passes enough that --steps, not one epoch, ends the run
                          ttt_steps=a.ttt_steps, batch_tokens=a.batch_tokens, lr=a.lr,
                          warmup_steps=min(20, max(1, a.steps // 10)), val_sequences=min(32, max(1, len(common) // 8)),
                          eval_interval=max(a.steps, 1), save_interval=max(a.steps, 1), device="cpu",
                          resume=(draft / "train_state.pt").exists()),  # a rerun resumes
              target=target, progress=False)
        rows[name] = {"sequences": len(ds), "tokens": ds.num_tokens,
                      "loss_tokens": ds.manifest["totals"].get("loss_tokens"),
                      "heldout_acc0": {h: compact_states.measure(draft, hd, target, a.max_length)
                                       for h, hd in heldout.items()}}
        print(f"{name}: held-out acc@0 {rows[name]['heldout_acc0']}", file=sys.stderr, flush=True)

    report = {"argv": sys.argv, "target": DEFAULT_TARGET, "train_conversations": len(common),
              "heldout": {h: {"sequences": len(d), "tokens": d.num_tokens} for h, d in heldout.items()},
              "recipe": {"steps": a.steps, "lr": a.lr, "batch_tokens": a.batch_tokens, "ttt_steps": a.ttt_steps,
                         "max_length": a.max_length, "max_new_tokens": a.max_new_tokens},
              "runs": rows, "seconds": time.perf_counter() - start}
    (out / "regenerated_data.json").write_text(json.dumps(report, indent=1))
    names = {INPROCESS: "in process (fp32, dequantized Q4_1)"}
    print(f"\n{len(common)} ShareGPT first turns answered by every set, {a.max_new_tokens} new tokens greedy; "
          f"{a.steps} steps, lr {a.lr:g}, {a.batch_tokens} batch tokens, {a.ttt_steps} TTT steps\n")
    print("| training replies | sequences | tokens | " + " | ".join(
        f"held-out acc@0 ({names.get(h, 'llama-server ' + h)} replies, {heldout[h].num_tokens:,} tokens)"
        for h in heldout) + " |")
    print("|---|---|---|" + "---|" * len(heldout))
    for name, r in rows.items():
        print(f"| {names.get(name, 'llama-server ' + name)} | {r['sequences']} | {r['tokens']:,} | "
              + " | ".join(f"{r['heldout_acc0'][h]:.3f}" for h in heldout) + " |")
    print(f"\n{report['seconds']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
