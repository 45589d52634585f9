"""Draft vocabulary size against coverage and acceptance: the reference draft shrunk to fewer head rows.

    nice -n 10 python benchmarks/experiments/training/draft_vocab.py            # sizes 2048, 4096 and the reference's 8192

A smaller head makes a draft step cheaper on llama.cpp CPU; this says what it costs in
acceptance. Per size: token counts over the first ``--train-conversations`` ShareGPT
conversations (training data of the reference; loss-masked assistant tokens, the target's chat
template) pick the most frequent draft ids (``vocab_shrink.py``); the shrunk draft is saved
under ``--out``/vocab-<size>, judged by `eaglewire doctor --stored` on the held-out shards
(acc@0, cond acc@1..3, coverage of the target's argmax), exported to a llama.cpp GGUF and
loaded once by llama-server (a smoke run: 32 greedy tokens, no timing). Coverage here is the
share of the held-out shards' reply tokens (the data's own) whose target id is in the draft vocab.

The doctor judges only positions whose target token is inside the draft vocab, which flatters a
smaller vocab; so acc@0, cond acc@1..3 and τ are measured here too with every reply position
counted (a target token outside the vocab is a miss), on the same stored states.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from eaglewire.model.checkpoint import load_draft, save_draft
from eaglewire.data.conversations import load_conversations, tokenize_conversation
from eaglewire.data.shards import ShardDataset
from eaglewire.doctor.measure import step_rightness
from eaglewire.doctor.stored import stored_batches
from eaglewire.core.presets import cache_dir, data_path, resolve_draft
from eaglewire.model.target import load_tokenizer
from eaglewire.model.target_head import load_target_head
from eaglewire.model.ttt import counted_positions
from eaglewire.model.vocab import count_tokens, frequency_coverage
from eaglewire.model.vocab_shrink import shrink_to_frequent

SRC = Path(__file__).resolve().parents[3] / "src"
DOCTOR_TARGET = cache_dir() / "targets" / "SmolLM2-135M-Instruct.Q4_1-af376ba2c50dc702"
LLAMACPP = cache_dir() / "engines" / "llama.cpp-11434"


def cli(*args: str, log: Path) -> None:
    """Runs `eaglewire ARGS` with this tree's sources; its output goes to ``log``."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "eaglewire.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                            env=env, check=False).returncode
    if rc:
        raise RuntimeError(f"eaglewire {args[0]} exited {rc}; see {log}")


def train_counts(num_conversations: int, vocab_size: int, out: Path, max_length: int) -> torch.Tensor:
    """[V] assistant-token counts over the first conversations of ShareGPT (cached under ``out``)."""
    path = out / f"counts-sharegpt-{num_conversations}-{max_length}.pt"
    if path.is_file():
        return torch.load(path)
    tok = load_tokenizer("smollm2-135m")
    convs, _ = load_conversations(data_path("sharegpt"), limit=num_conversations)

    def pairs():
        for c in convs:
            t = tokenize_conversation(c, tok, max_length=max_length)
            yield torch.tensor(t.input_ids), torch.tensor(t.loss_mask)

    counts = count_tokens(pairs(), vocab_size)
    torch.save(counts, path)
    return counts


def make_draft(size: int, reference: Path, counts: torch.Tensor, counts_note: str, out: Path) -> Path:
    """The reference shrunk to ``size`` draft ids (the reference itself, copied, at its own size)."""
    target_dir = out / f"vocab-{size}"
    draft, contract, config = load_draft(reference)
    if size == draft.config.draft_vocab_size:
        shutil.copytree(reference, target_dir, dirs_exist_ok=True)
        return target_dir
    small = shrink_to_frequent(draft, counts, size)
    training = {**config.get("training", {}),
                "vocab_shrink": {"from": str(reference), "from_size": draft.config.draft_vocab_size,
                                 "size": size, "counted_tokens": int(counts.sum()), "counts": counts_note}}
    save_draft(target_dir, small, contract, training, dtype=torch.float16)
    return target_dir


def heldout_coverage(heldout: Path, t2d: torch.Tensor) -> float:
    ds = ShardDataset(heldout)
    return frequency_coverage(count_tokens((ds.tokens(i) for i in range(len(ds))), t2d.numel()), t2d)


def chain_acceptance(right: torch.Tensor, valid: torch.Tensor, chains: tuple[int, ...]) -> dict[str, float]:
    """right / valid [B, S, T] bool (step j from position t right; counts) -> acc@0, cond acc@1.., and
    per chain length n the mean tokens a round yields, 1 + leading right steps (capped at n),
    averaged over every position step 0 counts. A target token outside the draft vocab is a miss."""
    S = right.shape[1]
    lead = torch.cumprod(right.long(), dim=1).bool() & valid  # [B, S, T] steps 0..j all right
    out = {"acc@0": float(lead[:, 0].sum() / valid[:, 0].sum().clamp(min=1))}
    for j in range(1, S):
        base = lead[:, j - 1] & valid[:, j]  # [B, T] step j counts and the chain reached it
        out[f"cond acc@{j}"] = float((lead[:, j] & base).sum() / base.sum().clamp(min=1))
    starts = valid[:, 0]  # [B, T]
    for n in chains:
        accepted = lead[:, :n].sum(1)  # [B, T]
        out[f"tau {n}"] = 1.0 + float(accepted[starts].float().mean())
    return out


def full_vocab_acceptance(draft_dir: Path, target, ds: ShardDataset, *, steps: int, max_length: int,
                          chains: tuple[int, ...]) -> dict[str, float]:
    """The doctor's isolation accuracy on the stored states, but with every reply token counted:
    the doctor judges only tokens inside the draft vocab, which flatters a smaller one."""
    draft, contract, _ = load_draft(draft_dir)
    layout = list(contract.aux_boundaries)
    batches = stored_batches(ds, list(range(len(ds))), target, draft, labels="head", max_length=max_length)
    rights, valids = [], []
    for b in batches:
        right = step_rightness(draft, b, layout, steps=steps)  # [B, S, T]
        valid = torch.zeros_like(right)
        for j in range(steps):
            v = counted_positions(b.loss_mask, torch.ones_like(b.loss_mask, dtype=torch.bool), j)  # [B, T-1-j]
            valid[:, j, :v.shape[1]] = v
        rights.append(right.permute(1, 0, 2).reshape(steps, -1))  # [S, B*T]
        valids.append(valid.permute(1, 0, 2).reshape(steps, -1))  # [S, B*T]
    right = torch.cat(rights, dim=1)[None]  # [1, S, N]
    valid = torch.cat(valids, dim=1)[None]  # [1, S, N]
    return chain_acceptance(right, valid, chains) | {"positions": int(valid[0, 0].sum())}


def doctor(draft_dir: Path, args) -> dict:
    report = draft_dir / "doctor.json"
    cli("doctor", "--draft", str(draft_dir), "--target", str(args.doctor_target), "--data", str(args.heldout),
        "--include-training", "--num-sequences", "31", "--stored", "--steps", "4", "--json", str(report),
        log=draft_dir / "doctor.txt")
    return json.loads(report.read_text())


def export_gguf(draft_dir: Path) -> Path:
    out = draft_dir / "gguf"
    cli("export", "--to", "llamacpp", "--draft", str(draft_dir), "--out", str(out), "--outtype", "q8_0",
        "--target-outtype", "f32", log=draft_dir / "export.txt")
    return out / "draft-q8_0.gguf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smoke(gguf: Path, target: Path, server: Path, log: Path) -> str:
    """Loads ``gguf`` as llama-server's EAGLE-3 draft, asks for 32 greedy tokens -> what came back."""
    port = free_port()
    cmd = [str(server), "-m", str(target), "-md", str(gguf), "--spec-type", "draft-eagle3",
           "--spec-draft-n-max", "1", "--spec-draft-n-min", "0", "--spec-draft-p-min", "0",
           "-t", "1", "-tb", "1", "-td", "1", "-tbd", "1", "-np", "1", "-c", "2048", "--no-webui",
           "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 300
            while True:
                if proc.poll() is not None:
                    return f"llama-server exited {proc.returncode} (see {log})"
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.time() > deadline:
                    return f"llama-server not ready after 300 s (see {log})"
                time.sleep(2)
            body = json.dumps({"prompt": "The capital of France is", "n_predict": 32, "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                reply = json.loads(r.read())
            t = reply.get("timings", {})
            return (f"ok: {reply.get('tokens_predicted')} tokens, drafted {t.get('draft_n', '?')}, "
                    f"accepted {t.get('draft_n_accepted', '?')}")
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="reference", help="the draft to shrink")
    ap.add_argument("--sizes", default="2048,4096,8192", help="draft vocabulary sizes (the draft's own: as is)")
    ap.add_argument("--out", type=Path, default=Path("/work/runs/vocab"))
    ap.add_argument("--train-conversations", type=int, default=3000,
                    help="count tokens over the first N ShareGPT conversations (training data)")
    ap.add_argument("--max-length", type=int, default=1024, help="tokens per conversation, as in training")
    ap.add_argument("--heldout", type=Path, default=Path("/work/runs/heldout-shards"))
    ap.add_argument("--doctor-target", type=Path, default=DOCTOR_TARGET)
    ap.add_argument("--smoke-target", type=Path, default=Path("/work/runs/types/target-Q4_0.gguf"),
                    help="target GGUF llama-server loads with each draft GGUF (none: skip the smoke run)")
    ap.add_argument("--llama-server", type=Path, default=LLAMACPP / "build" / "bin" / "llama-server")
    ap.add_argument("--eval-length", type=int, default=1024,
                    help="tokens per held-out sequence for the all-token acc and τ (the doctor reads 160)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    reference = resolve_draft(args.draft)
    draft, _, _ = load_draft(reference)
    counts = train_counts(args.train_conversations, draft.config.vocab_size, args.out, args.max_length)
    note = f"assistant tokens of ShareGPT conversations 0..{args.train_conversations - 1}"
    rows = []
    head = load_target_head(str(args.doctor_target))
    heldout = ShardDataset(args.heldout, verify=False)
    for size in sorted(int(s) for s in args.sizes.split(",")):
        d = make_draft(size, reference, counts, note, args.out)
        small, _, _ = load_draft(d)
        report = doctor(d, args)
        acc = report["accuracy"]
        full = full_vocab_acceptance(d, head, heldout, steps=4, max_length=args.eval_length, chains=(1, 3))
        gguf = export_gguf(d)
        smoked = ("skipped" if str(args.smoke_target) == "none"
                  else smoke(gguf, args.smoke_target, args.llama_server, d / "smoke.log"))
        rows.append({"size": size, "dir": str(d),
                     "train coverage": frequency_coverage(counts, small.t2d),
                     "held-out coverage": heldout_coverage(args.heldout, small.t2d),
                     "doctor coverage": report["facts"]["draft vocab coverage"],
                     "doctor judged": report["facts"]["judged tokens"],
                     "doctor acc": [acc["acc@0"]] + [acc[f"cond acc@{j}"] for j in (1, 2, 3)],
                     "full": full,
                     "safetensors MiB": (d / "model.safetensors").stat().st_size / 2**20,
                     "gguf MiB": gguf.stat().st_size / 2**20, "smoke": smoked})
        print(f"vocab {size}: done ({smoked})", file=sys.stderr, flush=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print("| draft vocab | coverage: held-out replies (train) | coverage: target argmax | acc@0 | cond acc@1 | "
          "cond acc@2 | cond acc@3 | τ chain 1 | τ chain 3 | doctor acc@0 / cond@1..3 (in-vocab only) | "
          "safetensors | GGUF q8_0 | llama-server smoke |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f, a = r["full"], r["doctor acc"]
        print(f"| {r['size']:,} | {r['held-out coverage']:.3f} ({r['train coverage']:.3f}) | "
              f"{r['doctor coverage']:.3f} | {f['acc@0']:.3f} | {f['cond acc@1']:.3f} | {f['cond acc@2']:.3f} | "
              f"{f['cond acc@3']:.3f} | {f['tau 1']:.2f} | {f['tau 3']:.2f} | "
              f"{a[0]:.3f} / {a[1]:.3f} {a[2]:.3f} {a[3]:.3f} | "
              f"{r['safetensors MiB']:.1f} MiB | {r['gguf MiB']:.1f} MiB | {r['smoke']} |")
    print(f"\nacc and τ: every reply position of the first {args.eval_length} tokens of {len(heldout)} held-out "
          f"sequences "
          f"({rows[0]['full']['positions']:,} positions; a target argmax outside the draft vocab is a miss), "
          "on the stored states as `doctor --stored` feeds them. τ = 1 + leading right steps from every "
          "position (not a replay of rounds: the held-out text is ShareGPT's, not the target's greedy text). "
          f"The doctor (first 160 tokens, {rows[0]['doctor judged']:,} judged at the smallest size) judges "
          "only in-vocab tokens, hence its higher figures for smaller vocabs.")

if __name__ == "__main__":
    main()
