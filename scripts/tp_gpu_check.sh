#!/usr/bin/env bash
# Tensor parallelism on one host with >= 2 GPUs (device kind nvidia-h200-x2): the GPU TP tests,
# then TP=1 vs TP=2 throughput on the standard workload for the Qwen3-8B shape (the
# goal: TP=2 >= 1.7x TP=1) and the Qwen3-0.6B shape (communication-bound).
# Writes logs and JSON under $OUT (default ./gpu_out). Usage: bash scripts/tp_gpu_check.sh [tests|full]
# The device tool allows 10 minutes a command: T_TESTS and T_BENCH (per run) keep it inside that.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
MODE=${1:-full}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
# never NVLink multicast on shared hosts (see the device notes); the spawned workers inherit these
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "nccl", torch.cuda.nccl.version(), torch.cuda.device_count(), "x", torch.cuda.get_device_name())' | tee "$OUT/tp_env.txt"
nvidia-smi topo -m 2>/dev/null | tee -a "$OUT/tp_env.txt"

# 1. correctness: TP=2 == TP=1 in float32 (CUDA graphs capture the all-reduce), bf16 logits in tolerance
timeout ${T_TESTS:-150} python3 -m pytest -q -m gpu tests/tp -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/tp_gpu_tests.log"
[ "$MODE" = "tests" ] && { ls -la "$OUT"; exit 0; }

# 2. throughput: the same requests at TP=1 and TP=2, one run each
NUM=${NUM_SEQS:-256}
for SHAPE in qwen3-8b qwen3-0.6b; do
  MODEL=/tmp/$SHAPE
  [ -d $MODEL ] || python3 tools/make_random_model.py --shape $SHAPE --out $MODEL --device cuda 2>&1 | tail -3
  for TP in 1 2; do
    timeout ${T_BENCH:-110} python3 benchmarks/throughput.py --model $MODEL --num-seqs "$NUM" --tensor-parallel-size $TP \
      --label "tp$TP $SHAPE" --results-dir "$OUT" --out "$OUT/throughput_${SHAPE}_tp$TP.json" ${BENCH_ARGS:-} \
      2>&1 | grep -v Warning | tail -8
  done
done
python3 - "$OUT" <<'PY' | tee "$OUT/tp_scaling.json"
import json, os, sys
out = sys.argv[1]
res = {}
for shape in ("qwen3-8b", "qwen3-0.6b"):
    row = {}
    for tp in (1, 2):
        p = os.path.join(out, f"throughput_{shape}_tp{tp}.json")
        if os.path.exists(p):
            r = next((r for r in json.load(open(p)) if r.get("engine") == "pagedllm"), {})
            row[f"tp{tp}_tokens_per_s"] = r.get("tokens_per_s")
    if row.get("tp1_tokens_per_s") and row.get("tp2_tokens_per_s"):
        row["tp2_over_tp1"] = round(row["tp2_tokens_per_s"] / row["tp1_tokens_per_s"], 2)
    res[shape] = row
res["goal"] = "qwen3-8b tp2_over_tp1 >= 1.7"
print(json.dumps(res, indent=1))
PY
ls -la "$OUT"
