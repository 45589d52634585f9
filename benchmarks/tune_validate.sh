#!/bin/sh
# Does `eaglewire tune` predict llama.cpp's speed, and is its recommendation the fastest shape?
# Tune on MT-bench prompts 40.. (or HumanEval's), then bench plain and tune's top TOP shapes on the
# first N prompts of the same set, side by side; compare predicted with measured tok/s.
# Run alone on the machine (timings). ENGINE=eaglewire validates eaglewire's own engine instead. Usage:
#   TARGET=runs/types/target-F16.gguf DRAFT=draft-q8_0.gguf [FLAGS="-fa off"] [DATASET=mt-bench] [TEMP=0] \
#     [TOKENS=256] [N=10] [TOP=4] OUT=runs/tune-validate/f16-mtbench sh benchmarks/tune_validate.sh
set -eu
EW=${EW:-eaglewire}
PY=${PY:-python}
DATASET=${DATASET:-mt-bench}
TEMP=${TEMP:-0}
TOKENS=${TOKENS:-256}
N=${N:-10}
TOP=${TOP:-4}
MAX_STEPS=${MAX_STEPS:-4}
TUNE_PROMPTS=${TUNE_PROMPTS:-12}
THREADS=${THREADS:-2}
mkdir -p "$OUT"

FLAGS=${FLAGS:-}
ENGINE=${ENGINE:-llamacpp}
# ew COMMAND ARGS...: eaglewire COMMAND with the engine's flags (FLAGS stays one argument)
ew() {
  cmd=$1; shift
  if [ "$ENGINE" = llamacpp ]; then
    $EW --threads "$THREADS" "$cmd" --engine llamacpp --engine-target "$TARGET" --engine-draft "$DRAFT" \
      --engine-threads "$THREADS" --engine-flags "$FLAGS" "$@"
  else
    $EW --threads "$THREADS" "$cmd" --engine eaglewire "$@"
  fi
}
ew tune --draft reference --dataset "$DATASET" --offset 40 --num-prompts "$TUNE_PROMPTS" --max-steps "$MAX_STEPS" \
  --max-new-tokens "$TOKENS" --temperature "$TEMP" --out "$OUT/tune.json" > "$OUT/tune.txt" 2>&1
CONFIGS=$($PY -c "
import json, sys
r = json.load(open('$OUT/tune.json'))['ranked']
spec = [p['bench_config'] for p in r if p['shape']['n_max'] > 0][:$TOP]
print(';'.join(['1,0,0,0'] + spec))")
ew bench --draft reference --dataset "$DATASET" --num-prompts "$N" \
  --max-new-tokens "$TOKENS" --temperature "$TEMP" --configs "$CONFIGS" --out "$OUT/bench" --no-progress \
  > "$OUT/bench.txt" 2>&1
$PY - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
tune = json.load(open(f"{out}/tune.json"))
bench = json.load(open(f"{out}/bench/bench.json"))
measured = {r["name"].removeprefix("llamacpp "): r for r in bench["rows"]}
rec = tune["recommendation"]["shape"]["bench_config"]
fastest = max(measured.values(), key=lambda r: r["tokens_per_second"])
print("| shape | predicted tok/s | measured tok/s | error | predicted τ | measured τ |")
print("|---|---|---|---|---|---|")
for p in tune["ranked"]:
    m = measured.get(p["bench_config"])
    if m is None:
        continue
    err = p["tokens_per_second"] / m["tokens_per_second"] - 1
    mark = " (recommended)" if p["bench_config"] == rec else ""
    print(f"| {p['label']}{mark} | {p['tokens_per_second']:.1f} | {m['tokens_per_second']:.1f} | {err:+.1%} | "
          f"{p['tau']:.2f} | {m['tau_pooled'] or 1:.2f} |")
best = fastest["tokens_per_second"]
got = measured[rec]["tokens_per_second"] if rec in measured else float("nan")
print(f"\nrecommended {rec}: {got:.1f} tok/s = {got / best:.1%} of the fastest measured "
      f"({fastest['name']}, {best:.1f})")
EOF
