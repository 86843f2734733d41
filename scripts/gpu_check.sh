#!/usr/bin/env bash
# One call on the GPU machine: the throughput benchmark first (the number that matters), then the
# GPU tests, the HF side-by-side and the kernel benchmark, each under its own time limit (about
# 7 minutes in all on an H200, inside the device tool's 10-minute command limit).
# Writes logs and JSON under $OUT (default ./gpu_out; at most 8 files come back from the device tool:
# the benchmark rows all go to one $OUT/<gpu>.json). Usage: bash scripts/gpu_check.sh [full|bench|tests|check|conformance|memcheck|startup|decode|gemm|attention|quant|quant-models|offload|spec]
# (check = bench + tests, without the HF side-by-side and the kernel benchmark)
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
MODE=${1:-full}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
MODEL=/tmp/qwen3-0.6b
# the carried wheels (.whl/: llguidance; .whl/server/: fastapi, uvicorn, ...) where this Python lacks them
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH  # installed by an earlier mode of this machine
if ! python3 -c "import llguidance, fastapi, uvicorn" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl $(ls .whl/server/*.whl 2>/dev/null) || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
# conformance: the GPU conformance matrix (benchmarks/conformance.py: every family x graph mode x pool x
# prefix caching x async scheduling against HF, fp8 against the CPU fp8 path, 50 random configurations
# against eager), at most 8 minutes on one H200; rows in $OUT/conformance.jsonl
if [ "$MODE" = conformance ]; then
  timeout ${T_CONF:-480} python3 benchmarks/conformance.py --out "$OUT" --workers ${WORKERS:-12} ${CONF_ARGS:-} 2>&1 \
      | grep -v -i -E "warn|Writing model" | tail -40
  exit ${PIPESTATUS[0]}
fi
# spec: speculative decoding (docs/features/speculative-decoding.md): its GPU tests (greedy with == without on
# CUDA with the default graphs and async scheduling, eager, preemption, the bundled model, seeded sampling), then
# benchmarks/spec_decode.py: the Qwen3-0.6B shape in bf16 (copy and random workloads, batch 1-64, proposing at
# every batch size) and in float32 (greedy outputs equal), the bundled model on code edits; then the standard
# throughput workload with and without speculation (its default config). Rows in $OUT/spec_decode.jsonl, $OUT/*.json
if [ "$MODE" = spec ]; then
  timeout ${T_TESTS:-200} python3 -m pytest -q -m gpu -x tests/gpu/test_spec_decode_gpu.py -p no:cacheprovider > "$OUT/spec_tests.log" 2>&1
  grep -E "Error|error:|FAILED|passed|failed" "$OUT/spec_tests.log" | head -10
  [ -d $MODEL ] || python3 tools/make_random_model.py --shape qwen3-0.6b --out $MODEL 2>&1 | tail -1
  B="python3 benchmarks/spec_decode.py --k ${SPEC_K:-4} --repeat 2 --output-len 128 --out $OUT/spec_decode.jsonl"
  S="--model $MODEL --max-model-len 4096 --kv-cache-memory-bytes 8000000000"
  timeout ${T_BENCH:-150} $B $S --batches 1 8 16 32 64 --label "qwen3-0.6b bf16" 2>&1 | grep -v '^{' | tail -3
  timeout ${T_BENCH:-150} $B $S --dtype float32 --workloads copy --batches 1 8 --label "qwen3-0.6b float32" 2>&1 \
      | grep -v '^{' | tail -3
  timeout ${T_BENCH:-150} $B --model pagedllm/default_model --kv-cache-memory-bytes 2000000000 --workloads code random \
      --input-len 256 --batches 1 8 64 --label "bundled model" 2>&1 | grep -v '^{' | tail -3
  python3 -c "import json; [print({k: r[k] for k in ('label', 'workload', 'batch', 'k', 'tpot_ms', 'acceptance_rate', \
      'mean_acceptance_length', 'tpot_speedup', 'greedy_equal', 'equal_prefix_share')}) for r in map(json.loads, \
      open('$OUT/spec_decode.jsonl'))]"
  for spec in off on; do
    a=(); [ $spec = on ] && a=(--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}')
    timeout ${T_BENCH:-120} python3 benchmarks/throughput.py --model $MODEL --label "speculation $spec" \
        --results-dir "$OUT" "${a[@]}" 2>&1 | grep -v -i warn | tail -3
  done
  exit 0
fi
# quant-models: quantized weights on whole models (benchmarks/quant_models.py): QSHAPES (default qwen3-8b) in
# QFORMATS (default bf16, FP8 per channel, FP8 block-wise, AWQ, GPTQ), random bytes made on the device: weight
# bytes, capacity in 4,096-token sequences, batch-1 TPOT and the standard workload's throughput; $OUT/quant-models.jsonl
if [ "$MODE" = quant-models ]; then
  timeout ${T_QUANT:-560} python3 benchmarks/quant_models.py --shapes ${QSHAPES:-qwen3-8b} \
      --formats ${QFORMATS:-bf16 fp8-channel fp8-block awq gptq} --num-seqs ${NUM_SEQS:-256} \
      --out "$OUT/quant-models.jsonl" 2>&1 | grep -E '^\{|Error|error' | cut -c1-400
  exit 0
fi
# offload: the host KV tier (pagedllm bench offload, docs/features/host-kv-tier.md) on the Qwen3-0.6B shape
# with the pool shrunk to 2,048 blocks (32k tokens): a multi-turn chat behind 8 shared 1,024-token system
# prompts whose distinct prefix KV is ~2.5x the pool, with the tier off / 1x / 2x / 4x the pool (hit rate per
# tier, ideal hit rate, mean TTFT, throughput); the copy bandwidth each way and a 2,048-token prefix's load
# against its prefill; swap vs recompute under a 512-block pool that forces preemption. Rows in $OUT/offload.jsonl
if [ "$MODE" = offload ]; then
  [ -d $MODEL ] || python3 tools/make_random_model.py --shape qwen3-0.6b --out $MODEL 2>&1 | tail -1
  O="--model $MODEL --max-model-len 4096 --output-json $OUT/offload.jsonl"
  # CHAT_CONFIGS: ';'-separated extra flags, one chat run each (default: rounds, every conversation's turn at
  # once, 64 sequence slots); e.g. "--max-num-seqs 64;--max-num-seqs 64 --concurrency 16" adds 16 closed-loop clients
  IFS=';' read -ra CFGS <<< "${CHAT_CONFIGS:---max-num-seqs 64}"
  for cfg in "${CFGS[@]}"; do
    timeout ${T_CHAT:-300} python3 -m pagedllm bench offload $O $cfg --num-kv-blocks 2048 --scenario chat \
        --system-prompts 8 --system-len 1024 --conversations 96 --turns 4 --turn-len 128 --output-len 64 \
        --tier-multiples ${TIERS:-0 1 2 4} 2>&1 | grep '^{'
  done
  [ "${CHAT_ONLY:-0}" = 1 ] && exit 0
  O="$O --max-num-seqs 64"
  timeout ${T_COPY:-120} python3 -m pagedllm bench offload $O --num-kv-blocks 2048 --scenario copy --prefix-len 2048 \
      --tier-multiples 1 2>&1 | grep '^{'
  timeout ${T_SWAP:-150} python3 -m pagedllm bench offload $O --num-kv-blocks 512 --scenario preemption \
      --conversations 128 --turn-len 512 --output-len 512 --tier-multiples 4 2>&1 | grep '^{'
  exit 0
fi
# decode: the decode attention kernels side by side against a device copy (benchmarks/decode_attention.py:
# variant grids at 256 x 1,024, then batch/context/group/head-size shapes), $OUT/decode-attention.json
if [ "$MODE" = decode ]; then
  timeout ${T_DECODE:-540} python3 benchmarks/decode_attention.py --out "$OUT/decode-attention.json" ${DECODE_ARGS:---variants --shapes} 2>&1 | tail -60
  exit ${PIPESTATUS[0]}
fi
# gemm: the decode GEMM (ops/decode_gemm.py) against cuBLAS at Qwen3-0.6B's shapes, M 1-256 (GEMM_ARGS, default
# --sweep), $OUT/decode-gemm.json; then the decode step's graph replay at batch 1-256 with it and without
# (benchmarks/decode_step.py, $OUT/decode-step-{triton,cublas}.json); then the GPU tests of tests/ops/test_decode_gemm.py
if [ "$MODE" = gemm ]; then
  timeout ${T_GEMM:-240} python3 benchmarks/decode_gemm.py ${GEMM_ARGS:---sweep} 2>&1 | grep -v '^config' | tail -60
  mv decode-gemm.json "$OUT/" 2>/dev/null
  [ -d $MODEL ] || python3 tools/make_random_model.py --shape qwen3-0.6b --out $MODEL 2>&1 | tail -1
  for g in ${GEMMS:-triton cublas}; do
    PAGEDLLM_DECODE_GEMM=$g timeout ${T_STEP:-120} python3 benchmarks/decode_step.py --model $MODEL \
        --batches ${BATCHES:-1,2,4,8,16,32,64,128,256} --label "decode gemm $g" --out "$OUT/decode-step-$g.json" 2>&1 \
        | grep -E '^\{|engine batch'
  done
  timeout ${T_TESTS:-150} python3 -m pytest -q -m gpu tests/ops/test_decode_gemm.py -p no:cacheprovider 2>&1 | tail -3
  exit 0
fi
# attention: the decode benchmark's shapes (DECODE_ARGS), the GPU kernel tests, then the standard throughput
# workload with fp8 KV (the TILES of this commit, then the tile before issue 30 through PAGEDLLM_ATTENTION_TILES)
# and with bf16 KV (VARIANTS: which of fp8 fp8-before fp8-batch-order bf16; fp8-batch-order: decode attention in
# batch order), rows in $OUT/<gpu>.json; ATTN_TESTS: more test paths; PROFILE_STEPS=a:b profiles those steps
# (timing perturbed) into $OUT/profile-<variant>.txt
if [ "$MODE" = attention ]; then
  timeout ${T_DECODE:-300} python3 benchmarks/decode_attention.py --out "$OUT/decode-attention.json" ${DECODE_ARGS:---shapes} 2>&1 | tail -50
  timeout ${T_TESTS:-150} python3 -m pytest -q -m gpu -x tests/ops ${ATTN_TESTS:-} -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  grep -E "Error|error:|FAILED|passed|failed" "$OUT/gpu_tests.log" | head -10
  [ -d $MODEL ] || python3 tools/make_random_model.py --shape qwen3-0.6b --out $MODEL 2>&1 | tail -1
  for v in ${VARIANTS:-fp8 fp8-before bf16}; do
    kv=fp8; [[ $v = bf16* ]] && kv=auto
    gemm=triton; [[ $v = *-cublas ]] && gemm=cublas  # fp8-cublas, bf16-cublas: F.linear for every product
    tiles=''; [ $v = fp8-before ] && tiles='{"decode/fp8": [128, 4, 2]}'
    order=longest; [ $v = fp8-batch-order ] && order=batch
    PAGEDLLM_ATTENTION_TILES="$tiles" PAGEDLLM_DECODE_LAUNCH_ORDER=$order PAGEDLLM_DECODE_GEMM=$gemm timeout ${T_BENCH:-120} python3 \
        benchmarks/throughput.py --model $MODEL --kv-cache-dtype $kv --label "$v ${LABEL:-}" --results-dir "$OUT" \
        ${PROFILE_STEPS:+--profile-steps $PROFILE_STEPS} 2>&1 | grep -v -i warn | tail -4
    [ -f "$OUT/profile_steps.txt" ] && mv "$OUT/profile_steps.txt" "$OUT/profile-$v.txt"
  done
  exit 0
fi
# quant: the block-wise FP8 GEMM's and the 4-bit GEMM's GPU tests (each kernel against its reference at Qwen3-8B's
# shapes, the group quantizer's bytes, CUDA-graph replays; log in $OUT/quant_tests.log), then their benchmarks:
# benchmarks/fp8_block_gemm.py (TFLOP/s against bf16 torch.matmul, rows in $OUT/fp8-block-gemm.json; SWEEP=1 adds
# the tile sweep at four M) and benchmarks/int4_gemm.py (TB/s of weight bytes for decode against the copy
# bandwidth, TFLOP/s for prefill, against bf16 torch.matmul; $OUT/int4-gemm.json; SWEEP=1: tiles and K splits).
# At most 8 minutes (the timeouts T_TESTS, T_BENCH, T_INT4; raise T_INT4 with SWEEP=1).
if [ "$MODE" = quant ]; then
  timeout ${T_TESTS:-180} python3 -m pytest -q -m gpu tests/ops/test_fp8_block_linear.py tests/ops/test_fp8_linear.py \
      tests/ops/test_int4_linear.py -p no:cacheprovider > "$OUT/quant_tests.log" 2>&1
  rc=$?; grep -E "Error|error:|FAILED|passed|failed" "$OUT/quant_tests.log" | head -20
  sweep=''; [ "${SWEEP:-0}" = 1 ] && sweep='--sweep --m 1 16 256 2048'
  OUT="$OUT" timeout ${T_BENCH:-180} python3 benchmarks/fp8_block_gemm.py $sweep 2>&1 | grep -v -i warn | tail -30
  OUT="$OUT" timeout ${T_INT4:-120} python3 benchmarks/int4_gemm.py ${sweep:---m 1 16 256 2048} 2>&1 \
      | grep -v -i warn | tail -16
  exit $rc
fi
# memcheck: every kernel family once under compute-sanitizer (benchmarks/memcheck.py); log in $OUT/memcheck.log
if [ "$MODE" = memcheck ]; then
  python3 -c "import sys; sys.path.insert(0, '.'); from benchmarks.conformance_models import write_models; write_models('/tmp/pagedllm-conformance')" >/dev/null 2>&1
  timeout ${T_MEMCHECK:-420} compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 50 \
      python3 benchmarks/memcheck.py > "$OUT/memcheck.log" 2>&1
  rc=$?; grep -E "^ok|ERROR SUMMARY|Invalid|Error" "$OUT/memcheck.log" | head -40; echo "memcheck rc=$rc"
  exit $rc
fi
# startup: LLM(...) and `pagedllm serve` start-up of the Qwen3-0.6B shape (bf16 and fp8 KV) and of a
# tiny model with the default pool (benchmarks/startup.py), rows in $OUT/startup.jsonl
if [ "$MODE" = startup ]; then
  [ -d $MODEL ] || python3 tools/make_random_model.py --shape qwen3-0.6b --out $MODEL 2>&1 | tail -1
  python3 -c "import sys; sys.path.insert(0, '.'); from benchmarks.conformance_models import write_models; write_models('/tmp/pagedllm-conformance')" >/dev/null 2>&1
  R=${STARTUP_RUNS:-2}  # STARTUP_VARIANT (a label for the rows) says what else differs, e.g. the bytecode cache
  timeout 200 python3 benchmarks/startup.py --model $MODEL --runs $R --serve --out "$OUT/startup.jsonl" 2>&1 | grep '^{'
  timeout 120 python3 benchmarks/startup.py --model $MODEL --runs $R --out "$OUT/startup.jsonl" -- --kv-cache-dtype fp8 2>&1 | grep '^{'
  timeout 120 python3 benchmarks/startup.py --model /tmp/pagedllm-conformance/qwen3 --runs 1 --out "$OUT/startup.jsonl" 2>&1 | grep '^{'
  exit 0
fi
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
