#!/usr/bin/env bash
# Latency on one GPU, in one call (issue 18; README, Benchmarks: Latency): the decode step's floor
# (benchmarks/decode_step.py), the prefill kernel against the matrix rate (benchmarks/kernels.py
# --prefill --sweep), one request's time stage by stage at 16 req/s (benchmarks/request_timeline.py),
# the serving benchmark (all at once and 16 req/s, scripts/serving_gpu_check.sh) and the offline
# throughput workload (nothing may get slower). Everything lands in $OUT/latency.tar.gz plus
# $OUT/summary.txt (the device tool brings back few files).
#
#   bash scripts/latency_gpu_check.sh [all|tests|decode|steps|prefill|timeline|serving|serve_inf|throughput|moe ...]
#   bash scripts/latency_gpu_check.sh timeline_inf    # the breakdown with all 500 requests at once (not in all)
#   bash scripts/latency_gpu_check.sh engine_inf      # the same workload through LLM.generate (not in all)
#   bash scripts/latency_gpu_check.sh api_cpu         # the API process's CPU time per token (not in all)
#   ASYNCIO_H11=1 bash scripts/latency_gpu_check.sh ...  # without the carried uvloop and httptools (the
#                                                         # GPU image has a uvloop of its own: h11 on uvloop)
#
# Server wheels (fastapi, uvicorn, ...) come from .whl/server/ when this Python lacks them.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; W=$OUT/latency; mkdir -p "$W"
PY=${PY:-python3}
MODES=${*:-all}
has() { [[ " $MODES " == *" all "* || " $MODES " == *" $1 "* ]]; }
if ! $PY -c "import fastapi, uvicorn, llguidance" 2>/dev/null && ls .whl/server/*.whl >/dev/null 2>&1; then
  # uvloop and httptools (the serve extra's event loop and HTTP parser) go to their own directory,
  # so that a run can leave them out (ASYNCIO_H11=1: h11, and asyncio unless this Python has a uvloop)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      $(ls .whl/server/*.whl | grep -v -E "uvloop|httptools") .whl/*.whl || exit 1
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_fast \
      .whl/server/uvloop*.whl .whl/server/httptools*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  [ "${ASYNCIO_H11:-0}" = 1 ] || export PYTHONPATH=/tmp/site_fast:$PYTHONPATH
fi
$PY -c "import importlib.util as u; print('event loop:', 'uvloop' if u.find_spec('uvloop') else 'asyncio', '| http:', 'httptools' if u.find_spec('httptools') else 'h11')"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
$PY -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, torch.cuda.get_device_name())' | tee "$W/env.txt"
MODEL=${MODEL:-/tmp/qwen3-0.6b}
[ -f $MODEL/config.json ] || $PY tools/make_random_model.py --shape qwen3-0.6b --out $MODEL 2>&1 | tail -1
S=$OUT/summary.txt; echo "commit $PAGEDLLM_COMMIT" > "$S"
if has tests; then   # first: the exactness tests (greedy identical, kernels against references)
  timeout ${T_TESTS:-240} $PY -m pytest -q -m gpu tests/ops tests/gpu tests/model/test_moe_gpu.py -p no:cacheprovider \
      > "$W/gpu_tests.log" 2>&1
  grep -E "FAILED|Error|passed|failed" "$W/gpu_tests.log" | tail -6 | tee -a "$S"
fi
if has decode; then
  timeout 180 $PY benchmarks/decode_step.py --model $MODEL --context 1024 --out "$W/decode.json" 2>&1 \
      | grep -v -i warn | tee -a "$S" | tail -12
fi
if has steps; then   # host time of steps that admit a prompt: eager, then in piecewise graphs
  PAGEDLLM_PREFILL_GRAPHS=eager timeout 120 $PY benchmarks/step_profile.py --model $MODEL --out "$W/step_profile_eager.json" 2>&1 \
      | grep -E "^prefill steps" | sed 's/^/eager: /' | tee -a "$S"
  timeout 120 $PY benchmarks/step_profile.py --model $MODEL --out "$W/step_profile.json" 2>&1 \
      | grep -E "^prefill steps" | sed 's/^/full + piecewise graphs: /' | tee -a "$S"
fi
if has prefill; then
  timeout 240 $PY benchmarks/kernels.py --prefill --sweep --out "$W/prefill.json" > "$W/prefill.log" 2>&1
  $PY - "$W/prefill.json" <<'PYEOF' | tee -a "$S"
import json, sys
r = json.load(open(sys.argv[1]))
print("matrix rate:", {k: round(v["TFLOPs"], 1) for k, v in r["matrix_rate"].items()})
for k, v in r.items():
    if k.startswith("prefill"):
        best = v.get("sweep_best", [{}])[0]
        print(k, round(v["TFLOPs"], 1), "TFLOP/s; best of sweep", {a: best.get(a) for a in ("BLOCK_Q", "BLOCK_N", "num_warps", "num_stages", "TFLOPs")})
print("torch flash:", r.get("torch_flash_1x4096"))
PYEOF
fi
if has timeline; then
  timeout 200 $PY benchmarks/request_timeline.py --model $MODEL --server-args "--device cuda ${SARGS:-}" \
      --num-prompts ${TL_NUM:-300} --request-rate 16 --out "$W/timeline.json" --label "${LABEL:-}" 2>&1 \
      | grep -v -E "INFO|WARN" | tee -a "$S" | tail -20
  timeout 200 $PY benchmarks/request_timeline.py --model $MODEL --server-args "--device cuda ${SARGS:-}" --text-prompts \
      --num-prompts ${TL_NUM:-300} --request-rate 16 --out "$W/timeline_text.json" --label "${LABEL:-} text prompts" 2>&1 \
      | grep -v -E "INFO|WARN" | tee -a "$S" | tail -20
fi
if [[ " $MODES " == *" timeline_inf "* ]]; then   # (not in "all") the breakdown with all 500 at once; one client
  # process: at ~50 us an SSE event it may itself be a bottleneck there (bench/load_generator.py)
  timeout 240 $PY benchmarks/request_timeline.py --model $MODEL --server-args "--device cuda ${SARGS:-}" \
      --num-prompts 500 --request-rate inf --out "$W/timeline_inf.json" --label "${LABEL:-} all at once" 2>&1 \
      | grep -v -E "INFO|WARN" | tee -a "$S" | tail -20
fi
if [[ " $MODES " == *" engine_inf "* ]]; then   # (not in "all") the all-at-once workload through LLM.generate
  timeout 150 $PY benchmarks/engine_bound.py --model $MODEL --device cuda --out "$W/engine_bound.json" 2>&1 \
      | grep engine_bound | tee -a "$S"
fi
if [[ " $MODES " == *" api_cpu "* ]]; then   # (not in "all") the API process's CPU per token, all at once
  timeout 200 $PY benchmarks/api_cpu.py --model $MODEL --server-args "--device cuda ${SARGS:-}" --num-prompts 500 \
      --input-len 512 --output-len 128 --label "${LABEL:-}" --out "$W/api_cpu.jsonl" 2>&1 \
      | grep -E '"(loop|http|api_cpu_us_per_token|api_cpu_ms_per_request|wall_s)"|throughput|TPOT' | tee -a "$S"
fi
if has serving; then
  OUT="$W/serving" MODEL=$MODEL T_ENGINE=1 T_BENCH=150 timeout 420 bash scripts/serving_gpu_check.sh 2>&1 \
      | tail -4 | tee -a "$S"
fi
if has serve_inf; then   # the serving benchmark, all at once only (16 req/s: the timeline run's TTFT/TPOT)
  timeout 150 $PY -m pagedllm bench serve --launch --model $MODEL --server-args "--device cuda ${SARGS:-}" \
      --num-prompts 500 --input-len 512 --output-len 128 --request-rate inf --seed 1 \
      --results-dir "$W" --result-name serving-gpu --label "all at once ${LABEL:-}" 2>&1 \
      | grep -E "throughput|TTFT|TPOT|Failed" | tee -a "$S"
fi
if has moe; then   # issue 19 on the same call: the MoE kernel (no sweep) and the Qwen3-30B-A3B shape
  mkdir -p "$W/moe"
  timeout ${T_MOE_KERNELS:-60} $PY benchmarks/moe.py --out "$W/moe/moe_kernels.json" 2>&1 | grep -v skip | tail -8 \
      | tee -a "$S"
  OUT="$W/moe" T_BENCH=${T_MOE_BENCH:-110} bash scripts/moe_gpu_check.sh throughput 2>&1 | tail -5 | tee -a "$S"
fi
if has throughput; then
  timeout 150 $PY benchmarks/throughput.py --model $MODEL --label "async scheduling (the default) ${LABEL:-}" \
      --results-dir "$W" 2>&1 | grep -v -i warn | tail -6 | tee -a "$S"
fi
tar -C "$OUT" -czf "$OUT/latency.tar.gz" latency && rm -rf "$W"
ls -la "$OUT"
