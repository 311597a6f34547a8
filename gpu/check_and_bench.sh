#!/usr/bin/env bash
# Device run: install carried FlashInfer wheels, run the CUDA tests, the DCP
# correctness check against float32 full attention, and the benchmarks.
# Usage (repo root, on the device): bash gpu/check_and_bench.sh [all|check|bench|decode]  (decode = check + decode bench)
# Writes logs and a results tarball under $OUT (or ./.out).
set -u
MODE=${1:-all}
OUT=${OUT:-.out}; mkdir -p "$OUT"
RES=/tmp/dcp_results; rm -rf $RES; mkdir -p $RES
export PYTHONUNBUFFERED=1
T0=$(date +%s)
step() { echo; echo "=== $1 ($(( $(date +%s) - T0 ))s)"; }
step install
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl || echo "WHEEL INSTALL FAILED"
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || echo "NO FLASHINFER"
if [ "$MODE" != bench ]; then  # all, check, decode
  step pytest
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_dcp_metadata.py \
    tests/test_flashinfer_sm90_mla.py 2>&1 | tail -15
  step test_flashinfer_sm90_dcp
  FA3_DCP_CSV=$RES/check_flashinfer.csv timeout 240 python3 -m pytest -q -p no:cacheprovider \
    -W ignore tests/gpu/test_flashinfer_sm90_dcp.py 2>&1 | tail -15
  echo "check rc=${PIPESTATUS[0]}"
fi
if [ "$MODE" = decode ]; then
  step decode
  timeout 260 python3 -m benchmarks.decode --out-dir $RES 2>&1 | grep -v "it/s\]"
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  step metadata
  timeout 120 python3 -m benchmarks.metadata --out-dir $RES 2>&1 | grep -v "it/s\]"
  step decode
  timeout 260 python3 -m benchmarks.decode --out-dir $RES 2>&1 | grep -v "it/s\]"
  step combine
  timeout 80 python3 -m benchmarks.combine --out-dir $RES 2>&1 | grep -v "it/s\]"
fi
step done
tar czf $OUT/results.tar.gz -C $RES .
ls -la $RES
