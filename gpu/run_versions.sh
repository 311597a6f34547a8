#!/usr/bin/env bash
# Device run: for each FlashInfer version given, unpack it (trimmed zips under
# $WHL: v<version>.zip without the cutlass/cccl/spdlog headers, common.zip with
# them, the apache-tvm-ffi wheel), then run the CUDA adapter and split-KV
# kernel tests, the DCP check against float32 full attention (peaky + flat
# LSE-sensitivity passes; it also asserts that a planted off-by-one bound is
# caught) and the CUDA-graph replay check (FA3 prefix+tail and split-KV paths).
# PLANT=1 adds the planted graph run (FlashInfer's non-graph wrapper under a
# graph), which must fail.
# Usage (repo root, on the device): WHL=path bash gpu/run_versions.sh 0.7.4 0.7.2.post1
set -u
OUT=${OUT:-.out}; mkdir -p "$OUT"; RES=/tmp/dcp_results; rm -rf $RES; mkdir -p $RES
WHL=${WHL:-.whl}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
step() { echo; echo "=== $1 ($(( $(date +%s) - T0 ))s)"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
FIRST=""
for v in "$@"; do
  step "flashinfer $v: unpack"
  D=/tmp/fi_$v; rm -rf $D; mkdir -p $D
  unz() { python3 -m zipfile -e "$1" "$2"; }
  unz "$WHL/v$v.zip" $D && mkdir -p $D/flashinfer/data && unz "$WHL/common.zip" $D/flashinfer/data \
    && unz "$(ls "$WHL"/apache_tvm_ffi-*.whl)" $D || { echo "UNPACK FAILED"; continue; }
  export PYTHONPATH=$D:. FLASHINFER_WORKSPACE_BASE=/tmp/fiws_$v
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || continue
  [ -z "$FIRST" ] && FIRST=$v
  step "$v pytest"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_flashinfer_sm90_mla.py \
    tests/test_triton_dcp_metadata.py tests/test_triton_mla_split_kv.py 2>&1 | tail -6
  step "$v test_flashinfer_sm90_dcp"
  FA3_DCP_CSV=$RES/check_$v.csv timeout 240 python3 -m pytest -q -p no:cacheprovider -W ignore \
    tests/gpu/test_flashinfer_sm90_dcp.py 2>&1 | tee $RES/check_$v.txt | tail -4
  echo "check rc=${PIPESTATUS[0]}"
  step "$v check_graph"
  timeout 300 python3 -m gpu.check_graph 2>&1 | grep -v -i warn | tee $RES/graph_$v.txt
  echo "graph rc=${PIPESTATUS[0]}"
done
if [ "${PLANT:-0}" = 1 ] && [ -n "$FIRST" ]; then
  export PYTHONPATH=/tmp/fi_$FIRST:. FLASHINFER_WORKSPACE_BASE=/tmp/fiws_$FIRST
  step "planted non-graph FlashInfer wrapper ($FIRST)"
  timeout 100 python3 -m gpu.check_graph --heads 16 --world 2 --batches 3 \
    --paths fa3 --plant-plain-wrapper 2>&1 | grep -v -i warn | tee $RES/graph_planted.txt
  echo "planted graph rc=${PIPESTATUS[0]} (must be 1)"
fi
step done
tar czf $OUT/results.tar.gz -C $RES .
