#!/bin/sh
# llama.cpp as the engine CPU users serve (issue 18): export the reference draft as GGUF, then
# llama.cpp plain / + draft side by side with eaglewire's engine and HF generate on MT-bench first
# turns, with an f32, an f16 and the Q4_1 target GGUF; then doctor against a running llama-server.
# MEASURE ALONE ON THE MACHINE: llama.cpp's threads collapse to a few tok/s when anything else runs.
#   sh benchmarks/llamacpp_bench.sh     (OUT=runs/bench-llamacpp, N=24 prompts, THREADS=2)
set -eu
OUT=${OUT:-runs/bench-llamacpp}
N=${N:-24}
THREADS=${THREADS:-2}
PORT=${PORT:-8091}
PY=.venv/bin/python
EW=".venv/bin/eaglewire --threads $THREADS"
export OMP_NUM_THREADS=$THREADS
mkdir -p "$OUT"

# llama-server of the pinned build, into the user cache once (~25 min on 2 cores)
$EW engines install llamacpp --jobs "$THREADS"

# the reference draft as GGUF (q8_0), with the target as f32 and as f16 GGUF of eaglewire's weights
$EW export --to llamacpp --draft reference --out "$OUT/export-f32" --outtype q8_0 --target-outtype f32 --num-steps 3
$EW export --to llamacpp --draft reference --out "$OUT/export-f16" --outtype q8_0 --target-outtype f16 --num-steps 3
DRAFT="$OUT/export-f32/draft-q8_0.gguf"
Q41=$($PY -c "from eaglewire.core.presets import TARGET_PRESETS, fetch_asset; print(fetch_asset(TARGET_PRESETS['smollm2-135m'].asset))")

# plain and chains of 1 and 3 (llama.cpp: --spec-draft-n-max 1 / 3, n-min 0, p-min 0)
C="1,0,0,0;1,1,1,2;1,3,1,4"
COMMON="--draft reference --dataset mt-bench --num-prompts $N --max-new-tokens 128 --configs $C --no-progress"

# f32 target: eaglewire, llama.cpp and HF generate in one run (τ within ±0.05 of eaglewire's is the bar)
$EW bench $COMMON --engine eaglewire,llamacpp --compare hf --engine-threads "$THREADS" \
  --engine-target "$OUT/export-f32/target-f32.gguf" --engine-draft "$DRAFT" --out "$OUT/f32" > "$OUT/f32.txt" 2>&1
# f16 target, and the Q4_1 GGUF the preset ships (τ within ±0.1)
$EW bench $COMMON --engine llamacpp --engine-threads "$THREADS" \
  --engine-target "$OUT/export-f16/target-f16.gguf" --engine-draft "$DRAFT" --out "$OUT/f16" > "$OUT/f16.txt" 2>&1
$EW bench $COMMON --engine llamacpp --engine-threads "$THREADS" \
  --engine-target "$Q41" --engine-draft "$DRAFT" --out "$OUT/q4_1" > "$OUT/q4_1.txt" 2>&1
# the draft unquantized too (f32 GGUF), to tell a q8_0 draft's loss of acceptance from the engine's
$EW export --to llamacpp --draft reference --out "$OUT/export-f32-draft" --outtype f32 --target-outtype f32 --num-steps 3
$EW bench $COMMON --engine llamacpp --engine-threads "$THREADS" --engine-target "$OUT/export-f32/target-f32.gguf" \
  --engine-draft "$OUT/export-f32-draft/draft-f32.gguf" --out "$OUT/f32-draft-f32" > "$OUT/f32-draft-f32.txt" 2>&1

# doctor against a running llama-server (f32 target, chain of 3): served τ vs eaglewire's engine
SERVER=$($PY -c "from eaglewire.engines.llamacpp import require_server; print(require_server())")
FLAGS="-md $DRAFT --spec-type draft-eagle3 --spec-draft-n-max 3 --spec-draft-n-min 0 --spec-draft-p-min 0 -t $THREADS -tb $THREADS -td $THREADS -tbd $THREADS"
$SERVER -m "$OUT/export-f32/target-f32.gguf" $FLAGS --metrics --port "$PORT" > "$OUT/llama-server.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
$PY -c "
import time, urllib.request
for _ in range(600):
    try:
        urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2); break
    except Exception:
        time.sleep(0.5)
"
$EW doctor --draft reference --conversations sharegpt --offset 5000 --num-sequences 31 --steps 4 --engine llamacpp --engine-config "$DRAFT" --engine-flags "$FLAGS" \
  --engine-url "http://127.0.0.1:$PORT" --engine-prompts 8 --engine-tokens 64 > "$OUT/doctor.txt" 2>&1 || true
kill $PID
$PY benchmarks/experiments/llamacpp/llamacpp_divergence.py --export "$OUT/export-f32" --num-prompts "$N" --threads "$THREADS"
grep -h -A8 "^config" "$OUT"/f32.txt "$OUT"/f16.txt "$OUT"/q4_1.txt "$OUT"/f32-draft-f32.txt
tail -25 "$OUT/doctor.txt"
