#!/bin/sh
# The reference draft for SmolLM2-135M-Instruct, trained on CPU (2 threads): the recipe behind
# `--draft reference`. Every stage resumes: after an interruption, run it again.
#   sh benchmarks/reference_draft.sh            (RUNS=runs/reference by default)
# Wall time on 2 cores: ~31 min prepare, ~69 + ~50 min training (stage 1 at ~15 s/step, stage 2 at ~6.5 s).
set -eu
RUNS=${RUNS:-runs/reference}
EW=".venv/bin/eaglewire --threads 2"
export OMP_NUM_THREADS=2

# 1. 1,000 ShareGPT conversations -> 874 sequences, 679k tokens of captured states (3 GB)
$EW prepare --target smollm2-135m --data sharegpt --num-conversations 1000 --max-length 1024 --out "$RUNS/data"

# 2. TTT training, 7 steps, in two stages. Each stage resumes (rerun the script).
# 2a. a 330-step cosine schedule (lr 5e-4, 4096-token batches), stopped at step 223 (817k tokens,
#     ~69 min; the shipped draft stopped there on a time limit).
resume() { [ -f "$1/train_state.pt" ] && echo "--resume" || true; }
$EW train --target smollm2-135m --data "$RUNS/data" --out "$RUNS/draft-stage1" --ttt-steps 7 --epochs 2 \
  --max-steps 330 --lr 5e-4 --warmup-steps 15 --batch-tokens 4096 --val-sequences 32 \
  --eval-interval 50 --save-interval 25 --log-interval 5 --stop-at-step 223 $(resume "$RUNS/draft-stage1")
# 2b. continue from it under a fresh schedule: peak lr 8e-4 and 2048-token batches (in 30-step A/B
#     runs both learned faster per token: acc@0 0.183 vs 0.149 for lr 1.5e-3 vs 5e-4, 0.170 vs 0.149
#     for 2048 vs 4096 tokens per step). Same seed and --val-sequences: the same held-out split.
$EW train --target smollm2-135m --data "$RUNS/data" --init-draft "$RUNS/draft-stage1" --out "$RUNS/draft" \
  --ttt-steps 7 --epochs 2 --max-steps 450 --lr 8e-4 --warmup-steps 20 --batch-tokens 2048 --val-sequences 32 \
  --eval-interval 75 --save-interval 25 --log-interval 5 $(resume "$RUNS/draft") "$@"

# 3. held-out check on the target's own replies (conversations the training never saw)
$EW prepare --target smollm2-135m --data sharegpt --offset 5000 --num-conversations 32 --max-length 1024 \
  --regenerate --max-new-tokens 192 --out "$RUNS/heldout-regen"
$EW doctor --draft "$RUNS/draft" --data "$RUNS/heldout-regen" --num-sequences 32 \
  --max-length 1024 --json "$RUNS/doctor-heldout.json" || true

# 4. ship it: fp16 into the package (preset `reference`)
.venv/bin/python benchmarks/pack_draft.py "$RUNS/draft" src/eaglewire/assets/reference-smollm2-135m
