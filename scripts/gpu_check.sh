#!/usr/bin/env bash
# One call on the GPU machine: the throughput benchmark first (the number that matters), then the
# GPU tests, the HF side-by-side and the kernel benchmark, each under its own time limit (about
# 7 minutes in all on an H200, inside the device tool's 10-minute command limit).
# Writes logs and JSON under $OUT (default ./gpu_out; at most 8 files come back from the device tool:
# the benchmark rows all go to one $OUT/<gpu>.json). Usage: bash scripts/gpu_check.sh [full|bench|tests|check]
# (check = bench + tests, without the HF side-by-side and the kernel benchmark)
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
MODE=${1:-full}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
MODEL=/tmp/qwen3-0.6b
# the fused sampling kernel first: if it fails here, the rest runs on the torch sampler
if ! timeout 120 python3 -m pytest -q -m gpu -x tests/ops/test_sampling.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; then
  export PAGEDLLM_SAMPLER=torch; echo "sampler kernel tests FAILED: PAGEDLLM_SAMPLER=torch" | tee -a "$OUT/env.txt"
fi
tail -1 "$OUT/gpu_tests.log"
if [ "$MODE" != "tests" ]; then
  [ -d $MODEL ] || python3 tools/make_random_model.py --shape qwen3-0.6b --out $MODEL 2>&1 | tail -3
  timeout ${T_BENCH:-120} python3 benchmarks/throughput.py --model $MODEL --num-seqs "${NUM_SEQS:-256}" \
      --no-async-scheduling --label "sync scheduling" --results-dir "$OUT" ${BENCH_ARGS:-} 2>&1 | grep -v -i warn | tail -15
  timeout ${T_BENCH:-120} python3 benchmarks/throughput.py --model $MODEL --num-seqs "${NUM_SEQS:-256}" \
      --label "async scheduling (the default)" --results-dir "$OUT" \
      ${BENCH_ARGS:-} 2>&1 | grep -v -i warn | tail -15
  # where the GPU time goes: torch.profiler over 5 decode steps at large batch (own run: timing perturbed)
  [ "${PROFILE:-1}" = 1 ] && timeout ${T_BENCH:-120} python3 benchmarks/throughput.py --model $MODEL \
      --profile-steps 300:305 --label "profiled run (timing perturbed)" --results-dir "$OUT" \
      2>&1 | grep -v -i warn | tail -3
fi
if [ "$MODE" != "bench" ]; then
  timeout ${T_TESTS:-200} python3 -m pytest -q -m gpu -x tests/ops tests/gpu -p no:cacheprovider \
      >> "$OUT/gpu_tests.log" 2>&1
  grep -E "Error|error:|FAILED|passed|failed" "$OUT/gpu_tests.log" | head -20
fi
if [ "$MODE" = "full" ]; then
  timeout ${T_HF:-150} python3 benchmarks/throughput.py --model $MODEL --num-seqs 64 --compare-hf \
      --label "async scheduling (the default)" --results-dir "$OUT" 2>&1 | grep -v -i warn | tail -8
  [ "${KERNELS:-1}" = 1 ] && timeout 60 python3 benchmarks/kernels.py --out "$OUT/kernels.json" 2>&1 | tail -12
fi
# SERVING=1: then the serving benchmarks (scripts/serving_gpu_check.sh), results under $OUT/results
# (packed into one serving.tar.gz: the device tool brings back at most 8 files)
if [ "${SERVING:-0}" = 1 ]; then
  OUT="$OUT/serving" MODEL=$MODEL T_ENGINE=120 T_BENCH=120 timeout 300 bash scripts/serving_gpu_check.sh 2>&1 | tail -12
  tar -C "$OUT" -czf "$OUT/serving.tar.gz" serving && rm -rf "$OUT/serving"
fi
ls "$OUT"
