#!/usr/bin/env bash
# Before/after on one GPU machine, in one call: the same benchmark for two trees, back to back,
# so that a refactor's "no regression" is measured on one machine rather than across sessions.
#
#   git archive REF | gzip > .ab/before.tar.gz      # here; .ab/ is ignored and carried
#   bash scripts/ab_gpu_check.sh throughput         # on the GPU: nano-vllm's workload, async then sync
#   bash scripts/ab_gpu_check.sh serving            # on the GPU: scripts/serving_gpu_check.sh for each tree
#   bash scripts/ab_gpu_check.sh step               # on the GPU: benchmarks/decode_step.py (graph replay at BATCHES,
#                                                   # default 1,4, and the engine's batch-1 step, host included)
#   bash scripts/ab_gpu_check.sh latency            # on the GPU: scripts/latency_gpu_check.sh $LAT_MODES (default
#                                                   # timeline: one request's stages at 16 req/s) for each tree
#   bash scripts/ab_gpu_check.sh tests              # on the GPU: pytest -m gpu (ops, gpu) on this tree only
#   (BEFORE_COMMIT / AFTER_COMMIT name the trees in the rows; BENCH_ARGS: more throughput flags, e.g.
#   "--kv-cache-dtype fp8"; SCHEDS=async: one run per tree; BEFORE_TAR: another archive than .ab/before.tar.gz)
#
# Each tree runs its own benchmark code. Rows go to $OUT/<before|after>-*.json (PAGEDLLM_COMMIT
# names the tree: BEFORE_COMMIT for the archive, this checkout's HEAD otherwise).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
MODE=${1:-throughput}
HERE=$PWD
BEFORE=/tmp/before
MODEL=${MODEL:-/tmp/qwen3-0.6b}
export PYTHONUNBUFFERED=1
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())' | tee -a "$OUT/env.txt"
SITE=""
if ! python3 -c "import fastapi, uvicorn, llguidance" 2>/dev/null && ls .whl/server/*.whl >/dev/null 2>&1; then
  # the carried wheels: the server's (.whl/server/) and llguidance (.whl/), which the model writer imports
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/server/*.whl $(ls .whl/*.whl 2>/dev/null) && SITE=/tmp/site
fi
[ -d /tmp/site ] && SITE=/tmp/site  # wheels installed before this script (llguidance: .whl/*.whl)
if [ "$MODE" != tests ]; then
  mkdir -p $BEFORE && tar -xzf "${BEFORE_TAR:-.ab/before.tar.gz}" -C $BEFORE || exit 1
  [ -d $MODEL ] || PYTHONPATH=$HERE${SITE:+:$SITE} python3 tools/make_random_model.py --shape qwen3-0.6b --out $MODEL 2>&1 | tail -2
fi
run_tree() {   # $1 = tag (before|after), $2 = tree, $3 = commit
  local tag=$1 tree=$2
  cd "$tree" || return 1
  export PYTHONPATH=$tree${SITE:+:$SITE} PAGEDLLM_COMMIT=$3
  if [ "$MODE" = step ]; then
    timeout ${T_STEP:-150} python3 benchmarks/decode_step.py --model $MODEL --batches ${BATCHES:-1,4} --label "$tag" \
        --out "$OUT/$tag-decode-step.json" ${STEP_ARGS:-} 2>&1 | grep -v -i warn | tail -4
  elif [ "$MODE" = throughput ]; then
    for sched in ${SCHEDS:-async sync}; do
      local flag=""; [ $sched = sync ] && flag="--no-async-scheduling"
      timeout ${T_BENCH:-150} python3 benchmarks/throughput.py --model $MODEL $flag --label "$tag: $sched scheduling" ${BENCH_ARGS:-} \
          --results-dir "$OUT/$tag" 2>&1 | grep -v -i warn | tail -4
    done
  elif [ "$MODE" = latency ]; then
    OUT="$OUT/$tag-latency" MODEL=$MODEL timeout ${T_TREE:-280} bash scripts/latency_gpu_check.sh ${LAT_MODES:-timeline} \
        2>&1 | grep -E "ttft|tpot|median|commit" | head -30
  else
    OUT="$OUT/$tag-serving" MODEL=$MODEL T_ENGINE=${T_ENGINE:-100} T_BENCH=${T_SERVE:-100} \
        timeout ${T_TREE:-280} bash "$HERE/scripts/serving_gpu_check.sh" 2>&1 | tail -6
    tar -C "$OUT" -czf "$OUT/$tag-serving.tar.gz" "$tag-serving" && rm -rf "$OUT/$tag-serving"
  fi
  cd "$HERE"
}
case "$MODE" in
  throughput|serving|step|latency)
    # the device copy's .git may describe another commit than the files: name it with AFTER_COMMIT
    after_commit=${AFTER_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo after)}
    if [ "${ORDER:-}" = reverse ]; then   # after first: an order effect shows as a swapped result
      run_tree after "$HERE" "$after_commit"; run_tree before $BEFORE "${BEFORE_COMMIT:-before}"
    else
      run_tree before $BEFORE "${BEFORE_COMMIT:-before}"; run_tree after "$HERE" "$after_commit"
    fi
    ;;
  tests)
    PYTHONPATH=$HERE${SITE:+:$SITE} timeout ${T_TESTS:-400} python3 -m pytest -q -m gpu tests/ops tests/gpu -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -15
    ;;
esac
ls -R "$OUT" | head -30
