#!/bin/sh
# eaglewire vs speculators 0.9 (issue 3): the same sequences, token budget and recipe, both judged
# by `doctor` on the held-out set of the target's own replies. Needs the peer environment
# (see peer_speculators_check.py) and the shards + held-out set of benchmarks/reference_draft.sh.
#   sh benchmarks/experiments/peers/peer_side_by_side.sh
# Recipe for both: TTT 4, lr 1.5e-3, warm-up 10, cosine, 1,024-token batches (speculators packs a
# batch into one row with a dense mask, so its CPU cost grows with the square of the batch),
# one epoch over ~0.1M tokens. Train throughputs exclude setup, validation and checkpoints.
set -eu
ORIG=${ORIG:-runs/reference/data}
HELDOUT=${HELDOUT:-runs/reference/heldout-regen}
RUNS=${RUNS:-runs/peer}
PEER=${PEER:-/work/peer-venv/bin/python}
TOKENS=${TOKENS:-100000}
EW=".venv/bin/eaglewire --threads 2"
export OMP_NUM_THREADS=2

[ -f "$RUNS/peer-data/eaglewire_conversion.json" ] || .venv/bin/python benchmarks/experiments/peers/shards_to_speculators.py \
  --data "$ORIG" --max-tokens "$TOKENS" --shuffle 0 --out "$RUNS/peer-data" --eaglewire-out "$RUNS/ew-data" \
  --peer-python "$PEER" --overwrite
[ -f "$RUNS/ours/config.json" ] || $EW train --target smollm2-135m --data "$RUNS/ew-data" --out "$RUNS/ours" \
  --ttt-steps 4 --lr 1.5e-3 --warmup-steps 10 --batch-tokens 1024 --epochs 1 --val-sequences 8 \
  --eval-interval 1000 --save-interval 1000 --no-progress > "$RUNS/ours.log" 2>&1
[ -f "$RUNS/peer-draft/peer_metrics.json" ] || "$PEER" benchmarks/experiments/peers/peer_speculators_train.py --data "$RUNS/peer-data" \
  --out "$RUNS/peer-draft" --threads 2 --ttt-steps 4 --lr 1.5e-3 --warmup-steps 10 --batch-tokens 1024 \
  --epochs 1 --overwrite > "$RUNS/peer.log" 2>&1
[ -d "$RUNS/peer-ew" ] || $EW import --from speculators "$(ls -d "$RUNS"/peer-draft/*/ | tail -1)" \
  --target smollm2-135m --out "$RUNS/peer-ew"
for d in ours peer-ew; do
  [ -f "$RUNS/$d.json" ] || $EW doctor --draft "$RUNS/$d" --data "$HELDOUT" --num-sequences 32 --max-length 1024 \
    --steps 4 --json "$RUNS/$d.json" > "$RUNS/$d.doctor.txt" || true
done
grep -h "tokens_per_s" "$RUNS/peer-draft/peer_metrics.json" || true
grep -h -E "training tokens|wall time|time in" "$RUNS/ours.log" || true
