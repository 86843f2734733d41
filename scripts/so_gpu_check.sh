#!/usr/bin/env bash
# Structured output and the sampler's token controls on one GPU, one call per mode (each inside the
# device tool's 10-minute limit); llguidance travels as a wheel under .whl/ (carry it):
#   bash scripts/so_gpu_check.sh tests       # the GPU tests (sampler, controls, kernels, engine on CUDA)
#   bash scripts/so_gpu_check.sh throughput  # Qwen3-0.6B shape, standard workload: no schema vs a JSON schema
#                                            # on every request, and every request with repetition_penalty
#   bash scripts/so_gpu_check.sh micro       # the sampling step's controls and the mask fill at batch 256
# Rows and logs go under $OUT; PAGEDLLM_COMMIT names the tree (the device copy's .git may be stale).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
MODE=${1:-tests}
MODEL=${MODEL:-/tmp/qwen3-0.6b}
# llguidance (the engine's) and jsonschema (the tests') travel as wheels: .whl/*.whl
if ! python3 -c 'import llguidance, jsonschema' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
python3 -c 'import torch, triton, transformers, llguidance; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "llguidance", llguidance.__version__, torch.cuda.get_device_name())' | tee -a "$OUT/env.txt"
qwen() { [ -d $MODEL ] || python3 tools/make_random_model.py --shape qwen3-0.6b --out $MODEL --device cuda 2>&1 | tail -2; }
case "$MODE" in
  tests)
    timeout ${T_TESTS:-540} python3 -m pytest -q -m gpu tests/ops tests/gpu -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    # the token controls and structured output on CUDA (bf16 logits, the fused sampler, graphs, async scheduling)
    timeout 240 python3 -m pytest -q tests/ops/test_logits_controls.py tests/worker/test_token_controls_llm.py \
        tests/gpu/test_structured_output_gpu.py -p no:cacheprovider > "$OUT/gpu_controls_tests.log" 2>&1
    tail -3 "$OUT/gpu_controls_tests.log"
    grep -E "Error|error:|FAILED|passed|failed" "$OUT/gpu_tests.log" | head -30
    ;;
  throughput)
    qwen
    for so in none json; do
      timeout ${T_BENCH:-150} python3 benchmarks/throughput.py --model $MODEL --structured-output $so \
          --label "qwen3-0.6b shape, async scheduling, structured output: $so" --results-dir "$OUT" 2>&1 | grep -v -i warn | tail -3
    done
    ;;
  micro)
    timeout 200 python3 benchmarks/logits_controls.py --device cuda --no-save --out "$OUT/logits-controls.json" 2>&1 | tail -20
    # the mask fill runs on the host's CPUs (16 cores here): batch 256, and the bundled model's LLM run on CPU
    timeout 200 python3 benchmarks/structured_output.py --out "$OUT/structured-output-host.json" 2>&1 | tail -30
    ;;
esac
ls "$OUT"
