#!/usr/bin/env bash
# The H200 entry script: vLLM 0.32.0's Python tree + this overlay + FlashInfer
# from the carried bundle (gpu/README.md), then the named steps, each under a
# timeout, output under $OUT.
#
#   bash gpu/device_run.sh [tests] [bench] [decode] [fmla] [k3prefill] [finish] [step] [fa3dev]  (repo root, on the
#                                                         device; carry [".bundle"])
#   tests   the CUDA tests: FLASHINFER_MLA (sm90) and TRITON_MLA through
#           vLLM's classes (builders, forward_mqa, the selector, CUDA graphs
#           at every shape vLLM's CudaGraphManager captures), FA3 under DCP
#           against dense attention, the FA3 adapter and its device plan
#   bench   benchmarks/hopper_rows.py: FA3 vs TRITON_MLA rows bf16 / fp8 per
#           layer at the deployed head count (96)
#   decode  benchmarks/decode_step.py: 61-layer steps at 96 heads, batch 1
#   fmla    benchmarks/flashmla_rows.py: FLASHMLA under DCP per layer (96 and
#           128 heads, bf16 / fp8, vs FlashMLA alone, FA3, FlashInfer fp8),
#           the 61-layer step at W 1 and 8, the builders' host work
#   k3prefill benchmarks/k3_fp8_prefill.py: Kimi-K3's Hopper prefill over a
#           plain fp8 cache (bf16 query) against the bf16 prefill, one layer,
#           96 / 128 heads, 8K / 32K prompt tokens, checked against float32
#           (torch only: runs without the bundle too)
#   finish  benchmarks/flashmla_latency.py's finish part: FLASHMLA's layer at
#           batch 1-8 x 16-64K, 96 / 128 heads, FlashMLA alone, without the
#           finishing launch, with it as before issue 40 and as now (same call)
#   step    benchmarks/flashmla_rows.py's 61-layer step at batch 1 x 256K,
#           W 1 against W 8, 96 heads
#   fa3dev  benchmarks/fa3_device_plan.py: FA3 with its plan made on the
#           device for a lone request (FlashInfer's plans recorded, exactness
#           with graph replays over changing lengths, per layer against
#           FlashMLA alone / the FLASHMLA rows / FA3's host plan, the 61-layer
#           step at batch 1 x 256K); FA3DEV_ARGS replaces its arguments
# TESTS_K (a pytest -k expression) narrows the tests step.
set -u
OUT=${OUT:-.out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. "$(dirname "$0")/vllm_on_device.sh" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for step in "${@:-tests}"; do
  echo "=== $step"
  case $step in
    tests) timeout 500 python3 -m pytest -q -p no:cacheprovider -W ignore \
             tests/gpu/test_sm90_vllm_backend.py tests/test_triton_dcp_mla.py \
             tests/gpu/test_flashinfer_sm90_dcp.py tests/test_flashinfer_sm90_mla.py \
             tests/test_fa3_device_plan.py \
             ${TESTS_K:+-k "$TESTS_K"} \
             2>&1 | tee "$OUT/tests.txt" | tail -8 ;;
    bench) timeout 300 python3 -m benchmarks.hopper_rows \
             --out-dir "$OUT" 2>&1 | tee "$OUT/hopper_rows.txt" | grep -v -i warn ;;
    decode) timeout 200 python3 -m benchmarks.decode_step --heads 96 --batch 1 \
             --ctx 32768 262144 --world 1 8 --layers 61 --out-dir "$OUT" 2>&1 \
             | grep -v -i warn | tail -12 ;;
    fmla) timeout 420 python3 -m benchmarks.flashmla_rows --out-dir "$OUT" 2>&1 \
             | tee "$OUT/flashmla_rows.txt" | grep -v -i warn ;;
    k3prefill) timeout 280 python3 -m benchmarks.k3_fp8_prefill 2>&1 \
             | tee "$OUT/k3_fp8_prefill.txt" | grep -v -i warn ;;
    finish) timeout 330 python3 -m benchmarks.flashmla_latency --parts finish \
             ${FINISH_ARGS:---batch 1 2 4 8} --out-dir "$OUT" 2>&1 | tee "$OUT/finish.txt" | grep -v -i warn ;;
    step) timeout 200 python3 -m benchmarks.flashmla_rows --parts step --heads 96 \
             --step-batch 1 --out-dir "$OUT" 2>&1 | tee "$OUT/step.txt" | grep -v -i warn ;;
    fa3dev) timeout 510 python3 -m benchmarks.fa3_device_plan ${FA3DEV_ARGS:-} \
             --out-dir "$OUT" 2>&1 | tee "$OUT/fa3_device_plan.txt" | grep -v -i warn ;;
    *) echo "unknown step $step (tests, bench, decode, fmla, k3prefill, finish, step, fa3dev)"; exit 2 ;;
  esac
done
