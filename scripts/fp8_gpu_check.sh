#!/usr/bin/env bash
# fp8 KV cache on one GPU, one call per mode, each inside the device tool's 10-minute limit:
#   bash scripts/fp8_gpu_check.sh kernels     # GPU tests of the fp8 kernels and engine, kernel bench + fp8 sweep
#   bash scripts/fp8_gpu_check.sh throughput  # the standard throughput workload, auto (bf16) then fp8, + fp8 profile
#   bash scripts/fp8_gpu_check.sh quality     # accuracy (fp32 weights) and capacity (Qwen3-0.6B and 8B shapes)
#   bash scripts/fp8_gpu_check.sh tests       # every GPU test (regressions of the bf16 path included)
# Rows and logs go under $OUT; PAGEDLLM_COMMIT names the tree (the device copy's .git may be stale).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
MODE=${1:-kernels}
MODEL=${MODEL:-/tmp/qwen3-0.6b}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())' | tee -a "$OUT/env.txt"
case "$MODE" in
  kernels)
    timeout ${T_TESTS:-240} python3 -m pytest -q -m gpu -x tests/ops/test_kv_fp8.py tests/ops/test_paged_attention.py \
        tests/gpu/test_kv_fp8_gpu.py -p no:cacheprovider > "$OUT/fp8_gpu_tests.log" 2>&1
    grep -E "Error|error:|FAILED|passed|failed" "$OUT/fp8_gpu_tests.log" | head -20
    timeout 90 python3 benchmarks/kernels.py --kv-cache-dtype fp8 --out "$OUT/kernels-fp8.json" 2>&1 | tail -14
    timeout 150 python3 benchmarks/kernels.py --kv-cache-dtype fp8 --sweep --out "$OUT/kernels-fp8-sweep.json" 2>&1 | tail -14
    ;;
  throughput)
    [ -d $MODEL ] || python3 tools/make_random_model.py --shape qwen3-0.6b --out $MODEL 2>&1 | tail -2
    for kv in ${KVS:-auto fp8}; do
      timeout ${T_BENCH:-150} python3 benchmarks/throughput.py --model $MODEL --kv-cache-dtype $kv \
          --label "async scheduling, kv_cache_dtype=$kv" --results-dir "$OUT" ${BENCH_ARGS:-} 2>&1 | grep -v -i warn | tail -5
    done
    [ "${PROFILE:-1}" = 1 ] && timeout ${T_BENCH:-150} python3 benchmarks/throughput.py --model $MODEL --kv-cache-dtype fp8 \
        --profile-steps 300:305 --label "profiled run, kv_cache_dtype=fp8 (timing perturbed)" --results-dir "$OUT" \
        2>&1 | grep -v -i warn | tail -40
    ;;
  quality)
    timeout ${T_ACC:-200} python3 benchmarks/kv_cache_fp8.py accuracy --device cuda --dtype float32 --results-dir "$OUT" 2>&1 | tail -20
    [ -d $MODEL ] || python3 tools/make_random_model.py --shape qwen3-0.6b --out $MODEL 2>&1 | tail -2
    timeout 240 python3 benchmarks/kv_cache_fp8.py capacity --model $MODEL --verify --verify-timeout 100 --results-dir "$OUT" 2>&1 | tail -10
    python3 tools/make_random_model.py --shape qwen3-8b --out /tmp/qwen3-8b --device cuda 2>&1 | tail -2
    timeout 200 python3 benchmarks/kv_cache_fp8.py capacity --model /tmp/qwen3-8b --results-dir "$OUT" 2>&1 | tail -10
    ;;
  tests)
    timeout ${T_TESTS:-500} python3 -m pytest -q -m gpu tests/ops tests/gpu -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    grep -E "Error|error:|FAILED|passed|failed" "$OUT/gpu_tests.log" | head -30
    ;;
esac
