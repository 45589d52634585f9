#!/bin/sh
# The reference draft for SmolLM2-135M-Instruct, trained on CPU (2 threads): the recipe behind
# `--draft reference`. Every stage resumes: after an interruption, run it again.
#   sh benchmarks/reference_draft.sh            (RUNS=runs/reference by default)
# Wall time on 2 cores, measured: ~31 + ~60 + ~41 + ~40 min prepare, ~27 + ~60 + ~41 + ~41 + ~58 + ~31 + ~32
# min training (~8 h in all), TTT 4 throughout
# (one TTT-4 epoch reached what the earlier TTT-7 multi-epoch recipe did in a fifth of the time:
# BENCHMARKS.md, "What data buys").
set -eu
RUNS=${RUNS:-runs/reference}
EW=".venv/bin/eaglewire --threads 2"
export OMP_NUM_THREADS=2
resume() { [ -f "$1/train_state.pt" ] && echo "--resume" || true; }
train() {  # out data extra-flags...: one TTT-4 pass, 2,048-token batches, the same held-out split
  out=$1; data=$2; shift 2
  $EW train --target smollm2-135m --data "$data" --out "$out" --ttt-steps 4 --epochs 1 --batch-tokens 2048 \
    --val-sequences 32 --eval-interval 250 --save-interval 25 --log-interval 5 $(resume "$out") "$@"
}

# 1. ShareGPT conversations 0-999 -> 874 sequences, 679k tokens of captured states (3 GB)
$EW prepare --target smollm2-135m --data sharegpt --num-conversations 1000 --max-length 1024 --out "$RUNS/data"
# 2. stage 1: one pass from scratch, peak lr 1.5e-3
train "$RUNS/draft-stage1" "$RUNS/data" --lr 1.5e-3 --warmup-steps 10
# 3. conversations 1000-2999, then stage 2: one pass over them from stage 1's weights and
#    vocabulary under a fresh schedule (peak lr 1e-3)
$EW prepare --target smollm2-135m --data sharegpt --offset 1000 --num-conversations 2000 --max-length 1024 \
  --out "$RUNS/data-1k-3k"
train "$RUNS/draft-stage2" "$RUNS/data-1k-3k" --init-draft "$RUNS/draft-stage1" --lr 1e-3 --warmup-steps 20
# 3b. conversations 3000-4399, then stage 3 the same way from stage 2
$EW prepare --target smollm2-135m --data sharegpt --offset 3000 --num-conversations 1400 --max-length 1024 \
  --out "$RUNS/data-3k-4k4"
train "$RUNS/draft-stage3" "$RUNS/data-3k-4k4" --init-draft "$RUNS/draft-stage2" --lr 1e-3 --warmup-steps 20
# 3c. stage 4: a second pass over stored data, no new capture (the latest set, then the larger
#     earlier one), each under a fresh schedule
train "$RUNS/draft-stage4a" "$RUNS/data-3k-4k4" --init-draft "$RUNS/draft-stage3" --lr 1e-3 --warmup-steps 20
train "$RUNS/draft-stage4" "$RUNS/data-1k-3k" --init-draft "$RUNS/draft-stage4a" --lr 1e-3 --warmup-steps 20
# 3d. stage 5: new data again, conversations 5032-6131 (5000-5031 are the held-out set below),
#     one pass from stage 4, then (5b) a second pass over it
$EW prepare --target smollm2-135m --data sharegpt --offset 5032 --num-conversations 1100 --max-length 1024 \
  --out "$RUNS/data-5k-6k1"
train "$RUNS/draft-stage5" "$RUNS/data-5k-6k1" --init-draft "$RUNS/draft-stage4" --lr 1e-3 --warmup-steps 20
train "$RUNS/draft" "$RUNS/data-5k-6k1" --init-draft "$RUNS/draft-stage5" --lr 1e-3 --warmup-steps 20 "$@"

# 4. held-out check on the target's own replies (conversations 5000-5031, never trained on)
$EW prepare --target smollm2-135m --data sharegpt --offset 5000 --num-conversations 32 --max-length 1024 \
  --regenerate --max-new-tokens 192 --out "$RUNS/heldout-regen"
$EW doctor --draft "$RUNS/draft" --data "$RUNS/heldout-regen" --num-sequences 32 --max-length 1024 --steps 4 \
  --json "$RUNS/doctor-heldout.json" || true

# 5. ship it: fp16 into the package (preset `reference`)
.venv/bin/python benchmarks/pack_draft.py "$RUNS/draft" src/eaglewire/assets/reference-smollm2-135m
