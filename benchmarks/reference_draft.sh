#!/bin/sh
# The reference draft for SmolLM2-135M-Instruct, trained on CPU (2 threads): the recipe behind
# `--draft reference`. Every stage resumes: after an interruption, run it again.
#   sh benchmarks/reference_draft.sh            (RUNS=runs/reference by default)
# Wall time on 2 cores: ~31 min prepare, ~80 min training (330 steps at ~15 s).
set -eu
RUNS=${RUNS:-runs/reference}
EW=".venv/bin/eaglewire --threads 2"
export OMP_NUM_THREADS=2

# 1. 1,000 ShareGPT conversations -> 874 sequences, 679k tokens of captured states (3 GB)
$EW prepare --target smollm2-135m --data sharegpt --num-conversations 1000 --max-length 1024 --out "$RUNS/data"

# 2. TTT training, 7 steps, ~1.6 epochs; add --minutes N to stop early (resumable)
RESUME=""
[ -f "$RUNS/draft/train_state.pt" ] && RESUME="--resume"
$EW train --target smollm2-135m --data "$RUNS/data" --out "$RUNS/draft" --ttt-steps 7 --epochs 2 \
  --max-steps 330 --lr 5e-4 --warmup-steps 15 --batch-tokens 4096 --val-sequences 32 \
  --eval-interval 50 --save-interval 25 --log-interval 5 $RESUME "$@"

# 3. held-out check on the target's own replies (conversations the training never saw)
$EW prepare --target smollm2-135m --data sharegpt --offset 5000 --num-conversations 32 --max-length 1024 \
  --regenerate --max-new-tokens 192 --out "$RUNS/heldout-regen"
$EW doctor --draft "$RUNS/draft" --data "$RUNS/heldout-regen" --num-sequences 32 \
  --max-length 1024 --json "$RUNS/doctor-heldout.json" || true

# 4. ship it: fp16 into the package (preset `reference`)
.venv/bin/python benchmarks/pack_draft.py "$RUNS/draft" src/eaglewire/assets/reference-smollm2-135m
