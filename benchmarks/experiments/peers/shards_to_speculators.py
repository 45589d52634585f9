"""Convert eaglewire hidden-state shards into speculators' (0.9) offline training layout.

Runs in eaglewire's environment; the Arrow dataset is written by the peer environment's
python (``--peer-python``; eaglewire's environment has no ``datasets``):

    .venv/bin/python benchmarks/experiments/peers/shards_to_speculators.py --data /work/runs/sharegpt1k \
        --max-tokens 100000 --out /work/runs/peer-data-100k [--eaglewire-out /work/runs/ew-data-100k]

Then train the peer on it with ``benchmarks/experiments/peers/peer_speculators_train.py`` (in the peer env).

What is written to OUT (what ``speculators train --data-path OUT`` reads):

- Arrow dataset (``datasets.save_to_disk``, torch format): one row per sequence with
  ``input_ids`` [T] int64, ``loss_mask`` [T] int64 (1 = assistant token, our mask verbatim),
  ``seq_len``. Rows are the training sequences (the first ones of ``--data``, in shard
  order or in a ``--shuffle`` order, while their tokens fit ``--max-tokens``), then
  ``--val-sequences`` more: speculators splits train/val by position (the first
  ``int(n * train_data_ratio)`` rows train), and its trainer demands a validation split.
- ``hidden_states/hs_{i}.safetensors`` for row i: ``token_ids`` [T] int64 (equal to the
  row's input_ids, which speculators checks) and ``hidden_states`` [T, k+1, H] in the
  shards' dtype (bf16, copied bit for bit).
- ``token_freq.pt``: {token id: count} of the loss-masked tokens of the training rows (our
  draft vocabulary counts the same tokens; speculators builds d2t/t2d from it for
  ``--draft-vocab-size``).
- ``verifier/``: a local verifier directory (no hub): the target's config.json, tokenizer
  files and a model.safetensors with only ``model.embed_tokens.weight`` and
  ``model.norm.weight`` (speculators loads the embedding, lm_head = tied embedding, and the
  final norm from it).
- ``eaglewire_conversion.json``: what was converted, counts, ``train_data_ratio`` and the
  layer ids for the trainer.

Convention mapping (checked against speculators 0.9 source: train/data.py
``ArrowDataset._get_raw_data``, models/eagle3/core.py ``forward``, models/utils.py
``resolve_target_layer_ids``, models/eagle3/data.py ``shift_batch``):

- ``hidden_states[:, :k]`` = our ``aux_hidden`` reshaped [T, k, H], boundaries in contract
  order. speculators reads ``hidden_states[:, :-1].flatten(1)`` as the fc input, so the
  concatenation order is ours. Its ``eagle_aux_hidden_state_layer_ids`` are boundaries
  verbatim (vLLM numbering: id b = input of layer b, 0 = embedding output), so boundaries
  [2, 15, 27] are ``--target-layer-ids 2 15 27`` (``engines.to_engine(.., "speculators")``).
- ``hidden_states[:, k]`` = our ``last_hidden`` = boundary L (L = 30 for SmolLM2-135M): the
  last decoder layer's output *before* the final norm. speculators reads
  ``hidden_states[:, -1]`` as ``verifier_last_hidden_states`` and computes its targets as
  ``verifier_lm_head(verifier_norm(state))``, i.e. it wants the pre-norm state, which is what
  vLLM's hidden-state extraction writes as layer id L (``launch_vllm.py
  --include-last-layer``). HF's ``output_hidden_states[L]`` (post-norm) would be wrong here.
- Alignment needs no shift here: speculators shifts itself (``shift_batch``: token t+1,
  aux state t, verifier state t+1), the same pairing as our trainer (position t sees g_t
  and the embedding of token t+1 and predicts the target's distribution at t+1).
- loss_mask is copied verbatim (1 on assistant tokens, both tools' meaning). Note
  speculators then weights the prediction of token u by mask[u-1] (its shift), where
  eaglewire uses mask[u]: the two differ on the first reply token of a turn and the token
  after a turn's last one.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglewire.engines import to_engine
from eaglewire.data.shards import ShardDataset, ShardWriter
from eaglewire.core.presets import DEFAULT_TARGET
from eaglewire.model.target import load_target, resolve_target_path
from eaglewire.model.vocab import count_tokens

log = logging.getLogger("shards_to_speculators")
REPO = Path(__file__).resolve().parents[3]
VERIFIER_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")

# Runs in the peer environment: rows.safetensors -> Arrow dataset, as speculators'
# preprocessing writes it (columns input_ids, loss_mask int64, seq_len; torch format).
_ARROW_SCRIPT = r"""
import sys
from datasets import Dataset
from safetensors.torch import load_file
rows, out = sys.argv[1], sys.argv[2]
t = load_file(rows)
off = t["offsets"].tolist()
ids, mask = t["input_ids"], t["loss_mask"]
ds = Dataset.from_dict({
    "input_ids": [ids[a:b].tolist() for a, b in zip(off, off[1:])],
    "loss_mask": [mask[a:b].tolist() for a, b in zip(off, off[1:])],
    "seq_len": [b - a for a, b in zip(off, off[1:])],
})
ds.set_format(type="torch")
ds.save_to_disk(out)
print(f"arrow dataset: {len(ds)} rows -> {out}")
"""


def pick_sequences(lengths: list[int], max_tokens: int, val_sequences: int,
                   shuffle: int | None = None) -> tuple[list[int], list[int]]:
    """(training indices: the first sequences whose tokens fit max_tokens, the next val_sequences).

    "First" in shard order, or in a random order seeded by ``shuffle``.
    """
    order = list(range(len(lengths)))
    if shuffle is not None:
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(shuffle)).tolist()
    train, total = [], 0
    for i in order:
        if total + lengths[i] > max_tokens:
            break
        train.append(i)
        total += lengths[i]
    if not train:
        raise SystemExit(f"--max-tokens {max_tokens} is below the first sequence's {lengths[order[0]]} tokens")
    val = order[len(train):len(train) + val_sequences]
    if len(val) < 1:
        raise SystemExit(f"no sequence is left for speculators' validation split: {len(lengths)} sequences "
                         "and the budget takes all of them; lower --max-tokens")
    return train, val


def write_verifier(target_dir: Path, out: Path) -> list[str]:
    """config.json + tokenizer files + the tensors speculators loads from the verifier."""
    out.mkdir(parents=True)
    for f in sorted(target_dir.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name != "DONE":
            shutil.copy2(f, out / f.name)
    tensors = {}
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        for name in VERIFIER_TENSORS:
            if name in f.keys():
                tensors[name] = f.get_tensor(name).contiguous()
    missing = {"model.embed_tokens.weight", "model.norm.weight"} - set(tensors)
    if missing:
        raise SystemExit(f"{target_dir}/model.safetensors lacks {sorted(missing)}")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return sorted(tensors)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="eaglewire shard directory")
    p.add_argument("--out", type=Path, required=True, help="speculators data directory to create")
    p.add_argument("--max-tokens", type=int, required=True,
                   help="token budget: the first sequences whose lengths sum to at most this")
    p.add_argument("--val-sequences", type=int, default=8,
                   help="sequences after the budget, for speculators' (mandatory) validation split")
    p.add_argument("--shuffle", type=int, metavar="SEED",
                   help="take sequences in a random order seeded by SEED instead of shard order "
                        "(shards from `eaglewire prepare` are sorted by length within each shard)")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="the target the shards were captured from (preset, HF dir or .gguf)")
    p.add_argument("--peer-python", default="/work/peer-venv/bin/python",
                   help="python of the speculators environment (writes the Arrow dataset)")
    p.add_argument("--eaglewire-out", type=Path,
                   help="also write the same sequences (train + val) as eaglewire shards here, so "
                        "`eaglewire train --data` sees exactly the peer's data")
    p.add_argument("--overwrite", action="store_true", help="replace --out (and --eaglewire-out)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    outs = [args.out] + ([args.eaglewire_out] if args.eaglewire_out else [])
    for out in outs:
        if out.resolve().is_relative_to(REPO):
            raise SystemExit(f"{out} is inside the repository {REPO}; write data outside it")
        if out.exists():
            if not args.overwrite:
                raise SystemExit(f"{out} exists; pass --overwrite or another path")
            shutil.rmtree(out)

    ds = ShardDataset(args.data)
    contract = ds.contract
    k, h, L = contract.num_aux, contract.target.hidden_size, contract.num_layers
    target = load_target(args.target, device="cpu", dtype="fp32")
    for w in contract.check_target(target.fingerprint, what=f"shards in {args.data}"):
        log.warning("%s", w)
    layer_ids = to_engine(list(contract.aux_boundaries), L, "speculators")
    train, val = pick_sequences(ds.lengths, args.max_tokens, args.val_sequences, args.shuffle)
    rows = train + val
    start = time.perf_counter()

    args.out.mkdir(parents=True)
    tokens = [ds.tokens(i) for i in rows]  # (input_ids [T], loss_mask [T]) per row
    ids_all, mask_all, offsets = [ids for ids, _ in tokens], [mask.long() for _, mask in tokens], [0]
    for ids in ids_all:
        offsets.append(offsets[-1] + ids.numel())
    counts = count_tokens(tokens[:len(train)], target.vocab_size)  # what our draft vocabulary counts
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = Path(tmp) / "rows.safetensors"
        save_file({"input_ids": torch.cat(ids_all), "loss_mask": torch.cat(mask_all),
                   "offsets": torch.tensor(offsets, dtype=torch.int64)}, str(rows_file))
        # first, into the still-empty OUT: save_to_disk owns the directory it writes
        subprocess.run([args.peer_python, "-c", _ARROW_SCRIPT, str(rows_file), str(args.out)], check=True)

    hs_dir = args.out / "hidden_states"
    hs_dir.mkdir()
    writer = None
    if args.eaglewire_out:
        writer = ShardWriter(args.eaglewire_out, contract, dtype=ds.dtype,
                             source={"converted_from": str(args.data), "rows": "first sequences",
                                     "max_tokens": args.max_tokens, "val_sequences": len(val)})
    for j, i in enumerate(rows):
        item = ds[i]
        t = item["input_ids"].numel()
        states = torch.cat([item["aux_hidden"].reshape(t, k, h), item["last_hidden"].reshape(t, 1, h)], dim=1)
        save_file({"token_ids": item["input_ids"].long().contiguous(), "hidden_states": states.contiguous()},
                  str(hs_dir / f"hs_{j}.safetensors"))
        if writer is not None:
            writer.add(ds.sequence_ids[i], item["input_ids"], item["loss_mask"], item["aux_hidden"],
                       item["last_hidden"])
    if writer is not None:
        writer.close()

    torch.save({int(t): int(c) for t, c in enumerate(counts.tolist()) if c}, args.out / "token_freq.pt")
    verifier_dir = args.out / "verifier"
    verifier_tensors = write_verifier(resolve_target_path(args.target), verifier_dir)

    n_train_tok = sum(ds.lengths[i] for i in train)
    meta = {
        "source": str(args.data.resolve()), "target": args.target, "contract": contract.to_dict(),
        "shard_dtype": ds.dtype, "max_tokens": args.max_tokens,
        "shuffle": args.shuffle, "train_rows": len(train), "val_rows": len(val),
        "train_tokens": n_train_tok, "train_loss_tokens": int(counts.sum()),
        "val_tokens": sum(ds.lengths[i] for i in val),
        # speculators: split_idx = int(rows * ratio); the midpoint keeps float rounding off the edge
        "train_data_ratio": (len(train) + 0.5) / len(rows),
        "target_layer_ids": layer_ids, "num_layers": L, "hidden_size": h,
        "verifier_last_hidden": f"boundary {L} (last layer output, before the final norm)",
        "hidden_states_layout": f"[T, {k + 1}, {h}]: aux boundaries {list(contract.aux_boundaries)} "
                                f"in order, then boundary {L}",
        "verifier_dir": str(verifier_dir.resolve()), "verifier_tensors": verifier_tensors,
        "sequence_ids": [ds.sequence_ids[i] for i in rows],
        "eaglewire_out": str(args.eaglewire_out.resolve()) if args.eaglewire_out else None,
    }
    (args.out / "eaglewire_conversion.json").write_text(json.dumps(meta, indent=1))
    log.info("wrote %s: %d training rows (%d tokens, %d under the loss mask) + %d validation rows; "
             "layer ids %s + verifier state boundary %d; %.1fs", args.out, len(train), n_train_tok,
             meta["train_loss_tokens"], len(val), layer_ids, L, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
