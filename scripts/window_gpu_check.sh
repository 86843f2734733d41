#!/usr/bin/env bash
# Per-layer KV kinds (sliding windows, Gemma 3) on one GPU, one call per mode, each inside the device
# tool's 10-minute limit:
#   bash scripts/window_gpu_check.sh tests       # every GPU test (windowed kernels, families, the bf16/fp8 paths)
#   bash scripts/window_gpu_check.sh kernels     # attention kernels with and without a window (benchmarks/kernels.py)
#   bash scripts/window_gpu_check.sh throughput  # Gemma-3-1B shape: the standard workload, + HF side by side (64)
#   bash scripts/window_gpu_check.sh decode      # Gemma-3-1B shape: one sequence to 32k tokens, blocks per group
# Rows and logs go under $OUT; PAGEDLLM_COMMIT names the tree (the device copy's .git may be stale).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
MODE=${1:-tests}
GEMMA=${GEMMA:-/tmp/gemma3-1b}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())' | tee -a "$OUT/env.txt"
gemma() { [ -d $GEMMA ] || python3 tools/make_random_model.py --shape gemma3-1b --out $GEMMA --device cuda 2>&1 | tail -2; }
case "$MODE" in
  tests)
    timeout ${T_TESTS:-540} python3 -m pytest -q -m gpu tests/ops tests/gpu -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    grep -E "Error|error:|FAILED|passed|failed" "$OUT/gpu_tests.log" | head -30
    ;;
  kernels)
    timeout 150 python3 benchmarks/kernels.py --out "$OUT/kernels.json" 2>&1 | tail -14
    timeout 240 python3 benchmarks/kernels.py --sliding-window ${WINDOW:-1024} --out "$OUT/kernels-window.json" 2>&1 | tail -30
    ;;
  throughput)
    gemma
    timeout ${T_BENCH:-200} python3 benchmarks/throughput.py --model $GEMMA --label "gemma3-1b shape, async scheduling" \
        --results-dir "$OUT" ${BENCH_ARGS:-} 2>&1 | grep -v -i warn | tail -6
    timeout ${T_HF:-300} python3 benchmarks/throughput.py --model $GEMMA --num-seqs 64 --compare-hf \
        --label "gemma3-1b shape, HF side by side" --results-dir "$OUT" 2>&1 | grep -v -i warn | tail -8
    ;;
  decode)
    gemma
    timeout ${T_DECODE:-540} python3 benchmarks/sliding_window.py --model $GEMMA --context ${CONTEXT:-32768} \
        --results-dir "$OUT" 2>&1 | tail -12
    ;;
esac
ls "$OUT"
