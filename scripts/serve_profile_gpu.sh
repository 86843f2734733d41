#!/usr/bin/env bash
# py-spy profiles of `pagedllm serve` under the all-at-once serving workload (issue 31): the engine
# core process and every API process, sampled at RATE Hz for DUR seconds while `pagedllm bench serve`
# sends 500 requests of 512 random tokens in / 128 out at once, RUNS times in a row. Writes under
# $OUT (every run its own seed: a repeat would hit the prefix cache): <process>.raw (py-spy's collapsed stacks, one line per stack with its sample count; read
# with benchmarks/profile_shares.py), bench.json (the client's rows), server.log, env.txt.
# Not validated on the GPU image: there py-spy 0.4.3 took 2 samples of the core in 16 s without --idle,
# and with it put the loop in its idle wait 97% of the time while it served (docs/benchmarks.md).
#
#   API=2 bash scripts/serve_profile_gpu.sh
#
# py-spy comes from .whl/prof/ (a wheel carried to the GPU machine), the server wheels from .whl/server/.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
PY=${PY:-python3}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl .whl/server/*.whl .whl/prof/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
$PY -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")' > "$OUT/env.txt"
echo "commit $PAGEDLLM_COMMIT" >> "$OUT/env.txt"
MODEL=${MODEL:-/tmp/qwen3-0.6b}
[ -f $MODEL/config.json ] || $PY tools/make_random_model.py --shape qwen3-0.6b --out $MODEL 2>&1 | tail -1
API=${API:-2}; RATE=${RATE:-250}; RUNS=${RUNS:-3}; DUR=${DUR:-18}; PORT=${PORT:-8000}
$PY -m pagedllm serve --model $MODEL --port $PORT --disable-uvicorn-access-log --api-server-count $API \
    ${SARGS:-} > "$OUT/server.log" 2>&1 &
spid=$!
for i in $(seq 1 240); do
  $PY -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" 2>/dev/null && break
  kill -0 $spid 2>/dev/null || { echo "server died"; tail -30 "$OUT/server.log"; exit 1; }
  sleep 1
done
B="$PY -m pagedllm bench serve --base-url http://127.0.0.1:$PORT --model $MODEL --input-len ${IN:-512} --output-len ${OUTLEN:-128}"
$B --num-prompts ${WARM:-100} --seed 1000 > /dev/null 2>&1  # warm-up: graphs, Triton, sockets (prompts of its own)
pids=$(ps -eo pid=,comm= | awk '$2 ~ /^pagedllm-(core|api)/ {print $1 ":" $2}')
echo "profiling: $pids"
for p in $pids; do
  py-spy record --pid ${p%%:*} --rate $RATE --duration $DUR --format raw --nonblocking \
      --output "$OUT/${p##*:}.raw" > "$OUT/${p##*:}.pyspy.log" 2>&1 &
done
sleep 1
for r in $(seq 1 $RUNS); do
  $B --num-prompts ${NUM:-500} --seed $r --results-dir "$OUT" --result-name bench 2>&1 | grep -E "Request throughput|Median TTFT|Median TPOT"
done
wait $(jobs -p | grep -v "^$spid$") 2>/dev/null
kill -TERM $spid; wait $spid
ls -la "$OUT"
