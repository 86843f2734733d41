#!/usr/bin/env bash
# One call on the GPU machine: kernel tests, engine GPU tests, kernel and throughput benchmarks.
# Writes logs and JSON under $OUT (default ./gpu_out). Usage: bash scripts/gpu_check.sh [quick|full]
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
MODE=${1:-full}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
python3 -m pytest -q -m gpu -x tests/ops tests/gpu -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
[ -f benchmarks/kernels.py ] && python3 benchmarks/kernels.py --out "$OUT/kernels.json" 2>&1 | tail -20
if [ "$MODE" != "tests" ]; then
  MODEL=/tmp/qwen3-0.6b
  [ -d $MODEL ] || python3 tools/make_random_model.py --shape qwen3-0.6b --out $MODEL 2>&1 | tail -3
  NUM=${NUM_SEQS:-256}
  python3 benchmarks/throughput.py --model $MODEL --num-seqs "$NUM" --results-dir "$OUT" --out "$OUT/throughput.json" ${BENCH_ARGS:-} 2>&1 | grep -v Warning | tail -15
  if [ "$MODE" = "full" ]; then
    python3 benchmarks/throughput.py --model $MODEL --num-seqs 64 --compare-hf --results-dir "$OUT" --out "$OUT/throughput_hf64.json" 2>&1 | grep -v Warning | tail -15
  fi
fi
ls -la "$OUT"
