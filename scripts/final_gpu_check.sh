#!/usr/bin/env bash
# What a closing note re-measures at its final commit (issues 30 and 31: exactness, the headline
# rows and "nothing else gets slower"), in four calls of under 10 minutes each on one GPU:
#   bash scripts/final_gpu_check.sh tests     # every GPU test: pytest -m gpu tests/gpu (158; 122 of them took
#                                             # 240 s on an H100), then tests/ops (147), each under a limit
#   bash scripts/final_gpu_check.sh core      # the conformance matrix (~3.5 min), then the standard
#                                             # workload with fp8 and with bf16 KV (async scheduling)
#   bash scripts/final_gpu_check.sh serving   # scripts/serving_gpu_check.sh with vLLM's client beside ours
#                                             # (one server: ~4.5 min; the engine alone first), then each
#                                             # client's own ceiling on this host (CEILING="4 8")
#   bash scripts/final_gpu_check.sh families  # the MoE (Qwen3-30B-A3B shape, dummy weights) and Gemma-3-1B
#                                             # throughput rows, without their HF side by sides
# The same work in two calls, for a session whose device time does not cover five:
#   bash scripts/final_gpu_check.sh exact     # the conformance matrix, tests/gpu and tests/ops at once
#                                             # (three processes on one GPU: correctness only, no timing)
#   bash scripts/final_gpu_check.sh rows      # core's two throughput rows, then families' (the GPU alone)
# Each part packs its rows and logs into $OUT/final-<part>.tar.gz (the device tool brings back few
# files) and prints a summary. Pass PAGEDLLM_COMMIT: the device copy's .git may name another commit.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; PART=${1:?tests, core, serving, families, exact or rows}
W=$OUT/final-$PART; mkdir -p "$W"
export PYTHONUNBUFFERED=1
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
if ! python3 -c "import fastapi, uvicorn, llguidance" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl $(ls .whl/server/*.whl 2>/dev/null) || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
export PYTHONPATH=$PWD:${PYTHONPATH:-}
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, torch.cuda.get_device_name())' | tee "$W/env.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$W/env.txt" 2>&1
echo "commit $PAGEDLLM_COMMIT" >> "$W/env.txt"
MODEL=${MODEL:-/tmp/qwen3-0.6b}
qwen() { [ -f $MODEL/config.json ] || python3 tools/make_random_model.py --shape qwen3-0.6b --out $MODEL 2>&1 | tail -1; }
gpu_tests() {  # $1: gpu or ops (tests/$1), $2: its limit (s); the log ends with pytest's exit code
  timeout $2 python3 -m pytest -q -m gpu tests/$1 -p no:cacheprovider > "$W/gpu_tests_$1.log" 2>&1
  echo "pytest tests/$1 exit $? (124: its $2 s limit)" >> "$W/gpu_tests_$1.log"
}
# the two timed pieces that core, families and rows share; $1: default step limit (s)
dense_rows() {
  qwen
  for kv in fp8 auto; do
    timeout ${T_BENCH:-$1} python3 benchmarks/throughput.py --model $MODEL --kv-cache-dtype $kv \
        --label "final: $kv KV, async scheduling (the default)" --results-dir "$W" 2>&1 | grep -v -i warn | tail -4
  done
}
family_rows() {  # $1: the MoE row's limit, $2: the Gemma-3 row's
  OUT="$W/moe" T_BENCH=${T_MOE:-$1} timeout $(( ${T_MOE:-$1} + 50 )) bash scripts/moe_gpu_check.sh throughput 2>&1 | tail -4
  # the Gemma-3 row alone (window_gpu_check.sh throughput adds an HF side by side of ~5 minutes)
  G=/tmp/gemma3-1b
  [ -d $G ] || python3 tools/make_random_model.py --shape gemma3-1b --out $G --device cuda 2>&1 | tail -1
  timeout ${T_GEMMA:-$2} python3 benchmarks/throughput.py --model $G --label "final: gemma3-1b shape, async scheduling" \
      --results-dir "$W/gemma3" 2>&1 | grep -v -i warn | tail -4
}
case "$PART" in
  tests)   # the engine's GPU tests (158), then the kernels' (147), each under its own limit
    for d in gpu ops; do
      lim=${T_GPU:-330}; [ $d = ops ] && lim=${T_OPS:-220}
      gpu_tests $d $lim; grep -E "FAILED|Error|passed|failed|pytest tests" "$W/gpu_tests_$d.log" | tail -8
    done
    ;;
  core)
    OUT="$W/conformance" timeout ${T_CONF:-280} bash scripts/gpu_check.sh conformance 2>&1 | tail -3
    dense_rows 120
    ;;
  serving)
    qwen
    # CEILING: each client against a stand-in server that costs nothing (benchmarks/client_ceiling.py), so
    # the rate a client can measure at all on this host stands beside the server's rows
    OUT="$W/serving" MODEL=$MODEL T_ENGINE=${T_ENGINE:-100} T_BENCH=${T_SERVE:-100} CEILING=${CEILING-4 8} \
        timeout ${T_TREE:-540} bash scripts/serving_gpu_check.sh 2>&1 | tail -16
    ;;
  families)
    family_rows 150 200
    ;;
  exact)   # correctness only, so the three share the GPU; each keeps its own log and limit
    # WORKERS 6, not 12: test_profiled_kv_sizing_... sizes its pool at 0.3 of the GPU less what others hold
    OUT="$W/conformance" WORKERS=${WORKERS:-6} timeout ${T_CONF:-480} bash scripts/gpu_check.sh conformance > "$W/conformance.log" 2>&1 &
    gpu_tests gpu ${T_TESTS:-480} &
    gpu_tests ops ${T_TESTS:-480} &
    wait
    tail -3 "$W/conformance.log"
    for d in gpu ops; do grep -E "FAILED|passed|failed|pytest tests" "$W/gpu_tests_$d.log" | tail -6; done
    ;;
  rows)    # timing: one process on the GPU at a time
    dense_rows 100
    family_rows 120 140
    ;;
  *) echo "unknown part: $PART (tests, core, serving, families, exact or rows)"; exit 2 ;;
esac
tar -C "$OUT" -czf "$OUT/final-$PART.tar.gz" "final-$PART" && rm -rf "$W"
ls -la "$OUT"
