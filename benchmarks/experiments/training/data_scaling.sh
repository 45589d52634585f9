#!/bin/sh
# What data buys (issue 3): held-out acc@0 / cond acc@1..3 against training tokens, ShareGPT's
# original replies vs the target's own, one recipe from scratch, judged by `doctor` on the
# reference's held-out set (31 conversations the target answered itself, never trained on).
#   sh benchmarks/experiments/training/data_scaling.sh        (resumes: rerun after an interruption)
# Inputs from benchmarks/reference_draft.sh: ORIG (its 679k-token shards of original replies)
# and HELDOUT (its held-out set). Writes RUNS/{data-regen,orig-*,regen-*}, RUNS/*.json.
# One epoch over each budget (the first N tokens of a fixed shuffle: max-steps x batch-tokens),
# TTT 4 (acc@0..3), lr 1.5e-3 (the faster of the short A/B runs), 2,048-token batches.
set -eu
ORIG=${ORIG:-runs/reference/data}
HELDOUT=${HELDOUT:-runs/reference/heldout-regen}
RUNS=${RUNS:-runs/scaling}
EW=".venv/bin/eaglewire --threads 2"
export OMP_NUM_THREADS=2
resume() { [ -f "$1/train_state.pt" ] && echo "--resume" || true; }

# The target's own first replies to 400 later conversations (offset 1000: after ORIG's, before
# HELDOUT's at 5000), 64 at a time through the batched lean decoder.
$EW prepare --target smollm2-135m --data sharegpt --offset 1000 --num-conversations 400 --max-length 1024 \
  --regenerate --max-turns 1 --regenerate-batch-size 64 --max-new-tokens 256 --out "$RUNS/data-regen"

train() {  # name data steps (0: one full epoch)
  steps=$([ "$3" -gt 0 ] && echo "--max-steps $3" || true)
  $EW train --target smollm2-135m --data "$2" --out "$RUNS/$1" --ttt-steps 4 --epochs 1 $steps \
    --lr 1.5e-3 --warmup-steps 10 --batch-tokens 2048 --val-sequences 32 --eval-interval 1000 \
    --save-interval 25 --log-interval 5 --no-progress $(resume "$RUNS/$1")
  [ -f "$RUNS/$1.json" ] || $EW doctor --draft "$RUNS/$1" --data "$HELDOUT" --num-sequences 32 \
    --max-length 1024 --steps 4 --json "$RUNS/$1.json" > "$RUNS/$1.doctor.txt" || true
}
train orig-100k "$ORIG" 49    # 49 x 2048 = 0.10M tokens
train regen-100k "$RUNS/data-regen" 49
train orig-300k "$ORIG" 147   # 0.30M
train orig-all "$ORIG" 0      # one epoch: ~0.65M (the training split of 679k)
.venv/bin/python benchmarks/experiments/training/scaling_table.py "$RUNS"
