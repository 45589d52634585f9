#!/bin/sh
# Whether a DFlash draft ships as a reference: it must beat the shipped EAGLE-3 reference in tokens/s in
# eaglewire's engine. Each draft at its own best shapes (the reference: a chain of one and the tree with
# --draft-min-prob 0.1, its fastest in BENCHMARKS.md; DFlash: chains of 3 and 7, the chain and a top-4 tree
# with a least path probability of 0.1), greedy, 256 tokens, MT-bench and HumanEval, each run with its own
# plain row, one after the other on a quiet machine, 2 threads.
#   DFLASH=runs/families/dflash OUT=runs/dflash-vs-reference sh benchmarks/experiments/training/dflash_vs_reference.sh  (~15 min)
set -eu
OUT=${OUT:-runs/dflash-vs-reference}
DFLASH=${DFLASH:?set DFLASH to a DFlash draft directory}
EW=".venv/bin/eaglewire --threads 2"
export OMP_NUM_THREADS=2
for d in mt-bench humaneval; do
  $EW bench --draft reference --dataset $d --num-prompts 6 --max-new-tokens 256 \
    --configs "1,0,0,0;1,1,1,2;1,5,4,12,0.1" --out "$OUT/reference/$d" --no-progress
  $EW bench --draft "$DFLASH" --dataset $d --num-prompts 6 --max-new-tokens 256 \
    --configs "1,0,0,0;1,3,1,4;1,7,1,8,0.1;1,7,4,12,0.1" --out "$OUT/dflash/$d" --no-progress
done
