#!/usr/bin/env bash
# One call of the lent GPU machine, prepared here: every step under its own timeout, each result written under
# $OUT as soon as it exists (a call cut short keeps what ran). Run from the repository root with gpu_kit/ carried
# (python benchmarks/gpu_harness.py kit --out gpu_kit, here):
#
#   bash benchmarks/gpu_session.sh tests     # <= 4 min on an H200: the cuda-marked tests
#   bash benchmarks/gpu_session.sh harness   # <= 9 min: every command on the 8B-shaped target, one table (its rows
#                                            # summed 6.4 min on the H200, serve not reached)
#   bash benchmarks/gpu_session.sh limits    # <= 9 min: decoding (graphs, then inductor), capture, the writer, training
#   DEVICE=cpu SHAPE=tiny bash benchmarks/gpu_session.sh harness  # the rehearsal here
#
# One stage a call (a call is at most 10 minutes); a session's 15 minutes of device time, the machine's start
# included, hold two of them: harness + tests proves issue 51, harness + limits measures issue 52.
#
# Issues 51 and 52: what each figure is, and the earlier run's, in BENCHMARKS.md ("Every command on a GPU",
# "The GPU at its limits").
set -u
stage=${1:?"tests, harness or limits"}
OUT=${OUT:-/tmp/gpu-session}
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-llama-3.1-8b}
WORK=${WORK:-/tmp/gpu-work}  # the target's weights and the commands' outputs: never under $OUT (they would travel)
PY=${PYTHON:-python}
mkdir -p "$OUT" "$WORK"
export EAGLEWIRE_TEST_TOKENIZER=$PWD/gpu_kit/tokenizer PYTHONPATH=$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}

step() {  # step NAME SECONDS CMD...: run under a timeout, its output in $OUT/NAME.txt, its time on the log
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout --kill-after 10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$name: rc $rc in $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
  lscpu | grep -E "Model name|^CPU\(s\)"
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  git log --oneline -1 2>/dev/null || true
} > "$OUT/machine.txt" 2>&1
$PY benchmarks/gpu_harness.py install --kit gpu_kit > "$OUT/install.txt" 2>&1

case $stage in
tests)
  step cuda_tests 240 $PY -m pytest -q -p no:cacheprovider -m cuda tests/test_devices.py tests/decode/test_runner.py \
    tests/decode/test_static_step.py tests/decode/test_spec_decoder.py tests/decode/test_dflash_decode.py tests/test_draft.py
  ;;
harness)
  step harness 540 $PY benchmarks/gpu_harness.py run --kit gpu_kit --device "$DEVICE" --shape "$SHAPE" \
    --out "$WORK/harness"
  mkdir -p "$OUT/harness" && cp -r "$WORK/harness/table.md" "$WORK/harness/table.json" "$WORK/harness/logs" \
    "$OUT/harness/" 2>/dev/null
  ;;
limits)
  step decode 120 $PY benchmarks/experiments/gpu/gpu_decode_probe.py --device "$DEVICE" --shape "$SHAPE" --reps 20 --tokens 128
  step capture 100 $PY benchmarks/experiments/gpu/gpu_capture_probe.py --device "$DEVICE" --shape "$SHAPE" --variants forward,new
  step shard_write 60 $PY benchmarks/experiments/data/shard_write.py --dir "$WORK/shard-write" --shards 1 --repeats 1
  step decode_compiled 160 $PY benchmarks/experiments/gpu/gpu_decode_probe.py --device "$DEVICE" --shape "$SHAPE" --reps 20 --compile
  step train 120 $PY benchmarks/experiments/gpu/gpu_train_probe.py --device "$DEVICE" --shape "$SHAPE" --budget 100
  ;;
*)
  echo "unknown stage $stage (tests, harness or limits)" >&2
  exit 2
  ;;
esac
