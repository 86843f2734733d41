#!/usr/bin/env bash
# Mixture-of-experts on one H200, in one call of about 7 minutes (each step under its own limit):
#   bash scripts/moe_gpu_check.sh            # all of the below, in order
#   bash scripts/moe_gpu_check.sh tests      # MoE GPU tests: the fused kernel at real shapes, in a CUDA
#                                            # graph; the tiny MoE models in the engine vs HF (fp32)
#   bash scripts/moe_gpu_check.sh kernels    # benchmarks/moe.py: decode 1-256 and prefill 8192 tokens,
#                                            # both expert shapes, + --sweep of block sizes (Qwen3 shape)
#   bash scripts/moe_gpu_check.sh throughput # Qwen3-30B-A3B shape (48 layers, load_format=dummy: random
#                                            # weights on the device, no checkpoint): the standard workload
#   bash scripts/moe_gpu_check.sh compare    # the same shape with 4 of its 48 layers (HF_LAYERS), a real
#                                            # checkpoint that both engines load: the first 64 requests,
#                                            # pagedllm and HF transformers continuous batching
#   bash scripts/moe_gpu_check.sh mixtral    # (not in "all") Mixtral-8x7B shape, 16 of 32 layers, dummy
#   bash scripts/moe_gpu_check.sh compare_mixtral  # (not in "all") as compare, Mixtral-8x7B shape with
#                                            # MIXTRAL_HF_LAYERS (2) of its 32 layers
# JSON and logs under $OUT: env.txt, moe_tests.log, moe_kernels.json, <gpu>.json (the throughput rows,
# labelled with what was compared). Step limits (s): T_TESTS 240 (the interpreter cases are slow), T_KERNELS 120 (SWEEP_S 60 of it),
# T_BENCH 100, T_HF 160: at most about 8 minutes, less when the steps finish early. PAGEDLLM_COMMIT names the tree (the device copy's .git may be stale).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
MODE=${1:-all}
Q30=${Q30:-/tmp/qwen3-30b-a3b}            # config + tokenizer only
HF_LAYERS=${HF_LAYERS:-4}
Q30_HF=${Q30_HF:-/tmp/qwen3-30b-a3b-${HF_LAYERS}l}  # a written checkpoint (~1.2 GiB per layer)
MIXTRAL=${MIXTRAL:-/tmp/mixtral-8x7b-16l}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
# pagedllm imports llguidance (structured output): from the carried .whl/ when this Python lacks it
if ! python3 -c "import llguidance" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/server/*.whl .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())' | tee -a "$OUT/env.txt"
run() { [ "$MODE" = all ] || [ "$MODE" = "$1" ]; }

if run tests; then
  # every test of the kernel file (on a GPU the small-shape ones run compiled too) and the engine ones
  timeout ${T_TESTS:-240} python3 -m pytest -q -m "gpu or not gpu" tests/ops/test_fused_moe.py tests/model/test_moe_gpu.py \
      -p no:cacheprovider > "$OUT/moe_tests.log" 2>&1
  grep -E "Error|error:|FAILED|passed|failed" "$OUT/moe_tests.log" | head -20
fi
if run kernels; then
  # the cases first (saved after each), then the sweep within its own budget (saved after each config)
  timeout ${T_KERNELS:-120} python3 benchmarks/moe.py --sweep --sweep-seconds ${SWEEP_S:-60} \
      --out "$OUT/moe_kernels.json" 2>&1 | grep -v "skip" | tail -12
fi
if run throughput; then
  [ -d $Q30 ] || python3 tools/make_random_model.py --shape qwen3-30b-a3b --out $Q30 --config-only 2>&1 | tail -1
  timeout ${T_BENCH:-100} python3 benchmarks/throughput.py --model $Q30 --load-format dummy \
      --label "qwen3-30b-a3b shape (48 layers), load_format=dummy, async scheduling" \
      --results-dir "$OUT" ${BENCH_ARGS:-} 2>&1 | grep -v -i warn | tail -6
fi
if run compare; then
  [ -d $Q30_HF ] || python3 tools/make_random_model.py --shape qwen3-30b-a3b --layers $HF_LAYERS --out $Q30_HF \
      --device cuda 2>&1 | tail -1
  timeout ${T_HF:-160} python3 benchmarks/throughput.py --model $Q30_HF --num-seqs 64 --compare-hf \
      --label "qwen3-30b-a3b shape with $HF_LAYERS of 48 layers: one checkpoint, loaded by both engines; first 64 requests" \
      --results-dir "$OUT" 2>&1 | grep -v -i warn | tail -8
fi
if [ "$MODE" = compare_mixtral ]; then
  MX_LAYERS=${MIXTRAL_HF_LAYERS:-2}; MX_HF=/tmp/mixtral-8x7b-${MX_LAYERS}l
  [ -d $MX_HF ] || python3 tools/make_random_model.py --shape mixtral-8x7b-16l --layers $MX_LAYERS --out $MX_HF \
      --device cuda 2>&1 | tail -1
  for hf in "" --hf-eager; do   # HF's CUDA graphs first, then (should that fail) without them
    timeout ${T_HF:-160} python3 benchmarks/throughput.py --model $MX_HF --num-seqs 64 --compare-hf $hf \
        --label "mixtral-8x7b shape with $MX_LAYERS of 32 layers: one checkpoint, loaded by both engines; first 64 requests" \
        --hf-memory-percent ${HF_MEM:-0.6} --results-dir "$OUT" 2>&1 | grep -v -i -E "warn|Loading" | tail -4
    grep -q '"error"' "$OUT"/*.json || break
  done
fi
if [ "$MODE" = mixtral ]; then
  [ -d $MIXTRAL ] || python3 tools/make_random_model.py --shape mixtral-8x7b-16l --out $MIXTRAL --config-only 2>&1 | tail -1
  timeout ${T_BENCH:-240} python3 benchmarks/throughput.py --model $MIXTRAL --load-format dummy \
      --label "mixtral-8x7b shape with 16 of 32 layers, load_format=dummy" --results-dir "$OUT" 2>&1 \
      | grep -v -i warn | tail -6
fi
ls "$OUT"
