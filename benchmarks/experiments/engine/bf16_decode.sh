#!/bin/sh
# Issue 41: eaglewire decoding in bf16 against fp32 and against llama.cpp's plain decoding, one bench run.
#   OUT=runs/i41 THREADS=2 sh benchmarks/experiments/engine/bf16_decode.sh
# 1. tune in bf16 (the shape that pays at bf16's round costs, on MT-bench #40-51);
# 2. bench on MT-bench #0-11 x 128 tokens: eaglewire fp32 and bf16, each plain and with tune's shape, and
#    llama.cpp (its best type here: the Q4_1 GGUF the target ships as) plain and with the draft, side by side.
# Run nothing else beside it: two multi-threaded jobs on 2 cores collapse each other.
set -eu
OUT=${OUT:-runs/i41}
THREADS=${THREADS:-2}
EW=${EW:-.venv/bin/eaglewire}
export OMP_NUM_THREADS=$THREADS
mkdir -p "$OUT"
"$EW" tune --draft reference --dtype bf16 --out "$OUT/tune_bf16.json"
GGUF=$(find "${EAGLEWIRE_CACHE:-$HOME/.cache/eaglewire}/assets" -name 'SmolLM2-135M-Instruct*.gguf' | head -1)
SHAPE=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['recommendation']['shape']['bench_config'])" "$OUT/tune_bf16.json")

"$EW" bench --draft reference --dataset mt-bench --num-prompts 12 --max-new-tokens 128 --dtype fp32,bf16 \
  --configs "1,0,0,0;$SHAPE" --engine eaglewire,llamacpp --engine-target "$GGUF" --engine-threads "$THREADS" \
  --out "$OUT/bench"
