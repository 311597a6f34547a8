#!/usr/bin/env bash
# One H200 call that checks and measures both sm90 paths (FA3 prefix+tail and
# split-KV) within a fixed time budget: steps run in priority order, each under
# a timeout cut to what is left, and every step's output lands in $OUT as it
# goes (a step cut short still leaves the lines it printed): logs and CSVs are
# written under /tmp/dev_results and packed into $OUT/results.tar.gz after
# every step (the device tool returns at most 8 files).
# Usage (repo root, on the device): BUDGET=seconds WHL=.whl bash gpu/device_session.sh
set -u
OUT=${OUT:-.out}; mkdir -p "$OUT"; RES=/tmp/dev_results; rm -rf $RES; mkdir -p $RES/b64 $RES/b8 $RES/h96
WHL=${WHL:-.whl}; BUDGET=${BUDGET:-240}; FI=0.7.2.post1
export PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# step NAME SECONDS CMD...: run CMD under min(SECONDS, time left - 5), log to $OUT/NAME.txt
step() {
  local name=$1 want=$2; shift 2
  local t; t=$(left); t=$(( t - 5 < want ? t - 5 : want ))
  if [ "$t" -lt 10 ]; then echo "=== $name skipped (no time left)"; return; fi
  echo "=== $name (at $(( $(date +%s) - T0 ))s, limit ${t}s)"
  timeout "$t" "$@" > "$RES/$name.txt" 2>&1
  echo "rc=$? after $(( $(date +%s) - T0 ))s"
  grep -v -i "warn" "$RES/$name.txt" | tail -n "${TAIL:-12}"
  tar czf "$OUT/results.tar.gz" -C $RES .
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
D=/tmp/fi_$FI; mkdir -p $D/flashinfer/data
python3 -m zipfile -e "$WHL/v$FI.zip" $D && python3 -m zipfile -e "$WHL/common.zip" $D/flashinfer/data \
  && python3 -m zipfile -e "$(ls "$WHL"/apache_tvm_ffi-*.whl)" $D || echo "FLASHINFER UNPACK FAILED"
export PYTHONPATH=$D:. FLASHINFER_WORKSPACE_BASE=/tmp/fiws
python3 -c "import torch, triton, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__)"
# 1. Both paths on CUDA: captured layer stacks replayed for changing batches == eager == dense;
#    every other batch repeats its lengths, so FA3's schedule is reused under the graph.
TAIL=20 step graph 150 python3 -m gpu.check_graph --paths fa3 split --batches 4
# 2. CUDA unit tests: the FA3 adapter (schedule reuse on FlashInfer's FA3 included), the
#    merged-ranks check against dense attention, the split-KV kernel.
TAIL=5 step pytest 120 python3 -m pytest -q -p no:cacheprovider -W ignore \
  tests/test_flashinfer_sm90_mla.py tests/gpu/test_flashinfer_sm90_dcp.py \
  tests/test_triton_mla_split_kv.py
# 3. Batch-1 decode steps (61 layers): the backend's paths, FA3 with exact prefixes (the
#    cost of whole-page tails) and with the old 16-key tail loop, the plan with repeated
#    and with changing lengths.
TAIL=40 step decode_step 150 python3 -m benchmarks.decode_step --layers 61 --batch 1 \
  --ctx 32768 262144 --world 1 2 4 8 --paths fa3 fa3-exact fa3:16x3 split --profile \
  --out-dir $RES
# 4. Batch 64 and 8, FA3 only (the backend's path there).
TAIL=12 step decode_step_b64 90 python3 -m benchmarks.decode_step --layers 61 --batch 64 \
  --ctx 32768 --world 1 8 --paths fa3 fa3-exact fa3:64x1 fa3:16x3 --out-dir $RES/b64
TAIL=12 step decode_step_b8 60 python3 -m benchmarks.decode_step --layers 61 --batch 8 \
  --ctx 32768 262144 --world 1 2 4 8 --paths fa3 --out-dir $RES/b8
# 5. 96 heads (Kimi-K3 at TP8 x DCP8 after the query gather), batch 1.
TAIL=8 step decode_step_h96 60 python3 -m benchmarks.decode_step --layers 61 --heads 96 \
  --batch 1 --ctx 262144 --world 1 8 --paths fa3 --out-dir $RES/h96
echo "=== done at $(( $(date +%s) - T0 ))s"
