"""How sure the draft is against how often it is right, per TTT step, on held-out shards.

    python benchmarks/experiments/training/draft_calibration.py --draft runs/reference/draft --data runs/reference/heldout-regen

For each step j and each bucket of the draft's top probability: the share of predictions in the
bucket and how many are right (the target's argmax), counting only positions where every earlier
step was right (what a chain sees). A draft whose accuracy rises with its confidence can skip
verifying tokens it is unsure of (`--draft-min-prob`); this table says where the line falls.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from eaglewire.model.checkpoint import load_draft
from eaglewire.data.shards import ShardDataset
from eaglewire.core.presets import DEFAULT_TARGET
from eaglewire.model.target import load_target
from eaglewire.model.ttt import target_signal, ttt_unroll

EDGES = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001]


@torch.no_grad()
def step_predictions(draft, target, seq: dict, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One sequence -> per step j: (top probability [N], right [N]) at the positions step j counts
    whose earlier steps were all right, fed exactly as in training (``ttt_unroll``)."""
    ids, mask = seq["input_ids"][None], seq["loss_mask"][None].bool()  # [1, T]
    emb = target.embed_tokens(ids).float()  # [1, T, H]
    signal = target_signal(target.head, seq["last_hidden"][None].float(), draft.draft_to_target, draft.t2d)
    out: list[tuple[torch.Tensor, torch.Tensor]] = []

    def observe(j, logits, right, cond):
        top = F.softmax(logits, dim=-1).max(-1).values  # [N]
        out.append((top[cond], right[cond]))

    ttt_unroll(draft, emb, seq["aux_hidden"][None].float(), mask, signal, ttt_steps=steps, observe=observe)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--data", required=True, help="held-out shards (e.g. the target's own replies)")
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--num-sequences", type=int, default=None, help="the first N sequences only")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    draft, _, _ = load_draft(args.draft)
    draft.eval()
    target = load_target(args.target, device="cpu")
    data = ShardDataset(args.data)
    n = len(data) if args.num_sequences is None else min(args.num_sequences, len(data))
    per_step = [([], []) for _ in range(args.steps)]
    for i in range(n):
        for (tops, rights), (top, right) in zip(per_step, step_predictions(draft, target, data[i], args.steps)):
            tops.append(top)
            rights.append(right)
    print(f"{args.draft} on {args.data} ({n} sequences)\n")
    print("| step | draft top probability | share | accuracy |\n|---|---|---|---|")
    for j, (tops, rights) in enumerate(per_step):
        top, right = torch.cat(tops), torch.cat(rights).float()
        print(f"| {j} | all ({len(top)} predictions) | 1.000 | {right.mean():.3f} |")
        for lo, hi in zip(EDGES[:-1], EDGES[1:]):
            sel = (top >= lo) & (top < hi)
            if sel.any():
                print(f"| {j} | [{lo:.1f}, {min(hi, 1.0):.1f}) | {sel.float().mean():.3f} | {right[sel].mean():.3f} |")


if __name__ == "__main__":
    main()
