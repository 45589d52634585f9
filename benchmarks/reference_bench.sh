#!/bin/sh
# The bench tables of BENCHMARKS.md / README with the reference draft: MT-bench and HumanEval
# greedy (with HF generate and HF prompt lookup in the same run), MT-bench at temperature 0.7.
#   sh benchmarks/reference_bench.sh            (OUT=runs/bench by default; ~30 min on 2 cores)
set -eu
OUT=${OUT:-runs/bench}
DRAFT=${DRAFT:-reference}
EW=".venv/bin/eaglewire --threads 2"
export OMP_NUM_THREADS=2
mkdir -p "$OUT"
# plain; chains of 1, 3 and 6 draft tokens; trees of one level (top 4) and of 5 levels; the chain
# of 6 and the tree with a least path probability (--draft-min-prob, the fifth field)
C="1,0,0,0;1,1,1,2;1,3,1,4;1,6,1,7;1,1,4,5;1,5,4,12;1,6,1,7,0.1;1,6,1,7,0.2;1,5,4,12,0.1"
for d in mt-bench humaneval; do
  $EW bench --draft "$DRAFT" --dataset $d --num-prompts 6 --max-new-tokens 128 --configs "$C" \
    --compare hf,hf-pld --out "$OUT/$d" --no-progress > "$OUT/$d.txt" 2>&1
done
$EW bench --draft "$DRAFT" --dataset mt-bench --num-prompts 6 --max-new-tokens 128 --temperature 0.7 \
  --configs "1,0,0,0;1,1,1,2;1,3,1,4;1,5,4,12;1,6,1,7,0.1;1,5,4,12,0.1" --compare hf --out "$OUT/mt-bench-t07" --no-progress \
  > "$OUT/mt-bench-t07.txt" 2>&1
