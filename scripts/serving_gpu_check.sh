#!/usr/bin/env bash
# The serving benchmarks (README, Serving) on one GPU, in one call: random Qwen3-0.6B, 500 requests of
# 512 in / 128 out, (1) all at once and (2) Poisson at 16 req/s, against `pagedllm serve` (engine
# core in its own process). Also the engine alone on the same workload, for reference.
# Writes five files under $OUT (default ./gpu_out): results/serving-gpu.json (one row per run,
# as `pagedllm bench serve` appends them), bench.txt, engine_only.json, server.log, env.txt.
# Where .whl/vclient/vllm_bench/benchmark_serving.py exists (vLLM's own client, v0.9.2, with its
# siblings; not committed: its README.txt), each server also gets that client's two runs right after
# ours, same workload: its JSON under $OUT/vllm-client/<tag>-<rate>.json, its table in bench.txt.
#
#   bash scripts/serving_gpu_check.sh            # the two runs
#   AB=1 bash scripts/serving_gpu_check.sh       # and again with --no-engine-process (engine thread)
#   SARGS="--max-num-seqs 512" bash scripts/serving_gpu_check.sh
#   API_COUNTS="1 2 4" bash scripts/serving_gpu_check.sh   # one server per --api-server-count
#   REPEATS=3 bash scripts/serving_gpu_check.sh    # three all-at-once runs per server (own prompts each)
#   CEILING="4 8" bash scripts/serving_gpu_check.sh  # and each client's own ceiling (benchmarks/client_ceiling.py)
#
# Server wheels (fastapi, uvicorn, ...) and llguidance are installed from .whl/server/ and .whl/ into
# /tmp/site when this Python lacks them; nothing is downloaded.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT/results"
PY=${PY:-python3}
if ! $PY -c "import fastapi, uvicorn, llguidance" 2>/dev/null && ls .whl/server/*.whl >/dev/null 2>&1; then
  # llguidance (.whl/*.whl): pagedllm imports it at start-up
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      $(ls .whl/*.whl 2>/dev/null) .whl/server/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
VB=.whl/vclient/vllm_bench   # vLLM's client; its wheels (aiohttp, datasets, ...) in .whl/vclient/
[ -f $VB/benchmark_serving.py ] || VB=
if [ -n "$VB" ] && ! $PY -c "import aiohttp, datasets" 2>/dev/null && ls .whl/vclient/*.whl >/dev/null 2>&1; then
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/vclient/*.whl; then
    [[ ":${PYTHONPATH:-}:" == *:/tmp/site:* ]] || export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  else echo "== vLLM client's wheels did not install: its runs are skipped"; VB=; fi
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
export PAGEDLLM_LOG_TRITON_COMPILES=${PAGEDLLM_LOG_TRITON_COMPILES:-1}  # compiles after start-up land in server.log
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
$PY -c 'import torch, transformers, fastapi, uvicorn, httpx; print("torch", torch.__version__, "transformers",
transformers.__version__, "fastapi", fastapi.__version__, "uvicorn", uvicorn.__version__,
torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' \
    | tee "$OUT/env.txt" || exit 1
nproc >> "$OUT/env.txt"
if [ -n "$VB" ]; then   # the client's imports, checked before any server starts
  (cd $VB && $PY -c 'import aiohttp, datasets, benchmark_serving
print("aiohttp", aiohttp.__version__, "datasets", datasets.__version__)') | sed "s/^/vLLM client $(cat $VB/VERSION): /" \
      | tee -a "$OUT/env.txt" || { echo "== vLLM client does not import: its runs are skipped"; VB=; }
fi
MODEL=${MODEL:-/tmp/qwen3-0.6b}
[ -f $MODEL/config.json ] || $PY tools/make_random_model.py --shape qwen3-0.6b --out $MODEL 2>&1 | tail -2
NUM=${NUM:-500}; IN=${IN:-512}; OUTLEN=${OUTLEN:-128}; RATE=${RATE:-16}
PORT=${PORT:-8000}
SARGS=${SARGS:-}
DEVICE=${DEVICE:-cuda}      # DEVICE=cpu MODEL=... NUM=40 IN=32 OUTLEN=16: a dry run of this script on CPU

# -- the engine alone (LLMEngine.step in a loop, streaming outputs), same workload; SARGS' engine
# flags (--max-num-seqs, ...) apply to it too, the server's own flags are left out --
timeout ${T_ENGINE:-180} $PY - "$MODEL" "$NUM" "$IN" "$OUTLEN" "$OUT/engine_only.json" "$DEVICE" "$SARGS" <<'EOF' 2>&1 | grep -v -i warn
import argparse, json, random, shlex, sys, time
from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.args import add_engine_args, engine_kwargs
model, num, inp, outl, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
flags, _ = add_engine_args(argparse.ArgumentParser()).parse_known_args(shlex.split(sys.argv[7]))
kwargs = {**engine_kwargs(flags), "model": model}
kwargs.setdefault("device", sys.argv[6])
llm = LLM(**kwargs)
tok = llm.tokenizer
special = set(tok.all_special_ids)
vocab = [i for i in range(len(tok)) if i not in special]
rng = random.Random(1)
p = SamplingParams(temperature=0, max_tokens=outl, ignore_eos=True)
llm.generate([rng.choices(vocab, k=inp) for _ in range(4)], p, use_tqdm=False)
e, rows = llm.engine, []
for stream in (False, True):
    for i in range(num):
        e.add_request(f"{stream}-{i}", rng.choices(vocab, k=inp), p, stream=stream)
    steps, t0 = [], time.perf_counter()
    while e.has_unfinished_requests():
        t = time.perf_counter(); e.step(); steps.append(time.perf_counter() - t)
    d = time.perf_counter() - t0
    row = {"stream": stream, "duration_s": round(d, 3), "request_throughput": round(num / d, 2),
           "output_throughput": round(num * outl / d, 1), "steps": len(steps),
           "median_step_ms": round(sorted(steps)[len(steps) // 2] * 1000, 3)}
    print("engine only:", row, flush=True)
    rows.append(row)
json.dump({"model": model, "num_prompts": num, "input_len": inp, "output_len": outl, "engine_flags": sys.argv[7], "runs": rows},
          open(path, "w"), indent=1)
EOF

serve_and_bench() {   # $1 = tag, $2 = extra server flags
  local tag=$1 extra=$2
  $PY -m pagedllm serve --model $MODEL --port $PORT --device $DEVICE --disable-uvicorn-access-log \
      $SARGS $extra > "$OUT/server_$tag.tmp" 2>&1 &
  local spid=$! i
  for i in $(seq 1 300); do
    $PY -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" \
        2>/dev/null && break
    kill -0 $spid 2>/dev/null || { echo "server died"; tail -40 "$OUT/server_$tag.tmp"; collect_log $tag; return 1; }
    sleep 1
  done
  echo "== $tag: server healthy after ${i}s"
  local children; children=$(ps -o pid= --ppid $spid | tr '\n' ' ')
  local B="$PY -m pagedllm bench serve --base-url http://127.0.0.1:$PORT --model $MODEL --num-prompts $NUM
           --input-len $IN --output-len $OUTLEN --results-dir $OUT/results --result-name serving-gpu"
  echo "#### $tag, all at once" >> "$OUT/bench.txt"
  timeout ${T_BENCH:-240} $B --seed 1 --label "$tag; all at once; server: $SARGS $extra" 2>&1 | tee -a "$OUT/bench.txt"
  local r  # REPEATS=N: N-1 more all-at-once runs, each with prompts of its own (a repeat would hit the prefix cache)
  for r in $(seq 2 ${REPEATS:-1}); do
    echo "#### $tag, all at once, run $r" >> "$OUT/bench.txt"
    timeout ${T_BENCH:-240} $B --seed $((100 + r)) --label "$tag; all at once, run $r; server: $SARGS $extra" 2>&1 \
        | tee -a "$OUT/bench.txt"
  done
  echo "#### $tag, $RATE req/s" >> "$OUT/bench.txt"
  timeout ${T_BENCH:-240} $B --seed 2 --request-rate $RATE --label "$tag; $RATE req/s; server: $SARGS $extra" 2>&1 \
      | tee -a "$OUT/bench.txt"
  if [ -n "$VB" ]; then   # vLLM's client, same workload: --model is the name the server answers to
    local name r seed=1; mkdir -p "$OUT/vllm-client"
    name=$($PY -c "import httpx; print(httpx.get('http://127.0.0.1:$PORT/v1/models').json()['data'][0]['id'])" \
        2>/dev/null) || name=$MODEL
    local V="$PY $VB/benchmark_serving.py --backend openai --base-url http://127.0.0.1:$PORT --endpoint /v1/completions
             --model $name --tokenizer $MODEL --dataset-name random --random-input-len $IN --random-output-len $OUTLEN
             --num-prompts $NUM --ignore-eos --disable-tqdm --save-result --result-dir $OUT/vllm-client
             --metadata pagedllm_commit=$PAGEDLLM_COMMIT server=$tag"
    for r in inf $RATE; do
      echo "#### $tag, $([ $r = inf ] && echo all at once || echo $r req/s): vLLM's benchmark_serving.py" \
          "$(cat $VB/VERSION)" >> "$OUT/bench.txt"
      timeout ${T_BENCH:-240} $V --seed $seed --request-rate $r --result-filename $tag-$r.json 2>&1 \
          | tee -a "$OUT/bench.txt"
      seed=2
    done
  fi
  kill -TERM $spid; wait $spid; echo "== $tag: server exit code $? (0 expected)"
  for i in $(seq 1 50); do   # the engine core (and multiprocessing's resource tracker) must be gone
    local left=""; for c in $children; do kill -0 $c 2>/dev/null && left="$left $c"; done
    [ -z "$left" ] && break; sleep 0.2
  done
  for c in $left; do echo "== $tag: LEFT BEHIND after 10 s: $(ps -o pid=,args= -p $c)"; done
  grep -E "ERROR|Traceback|throughput:" "$OUT/server_$tag.tmp" | tail -8
  collect_log $tag
}

collect_log() {  # and how many Triton compiles the server logged after it was ready (each stalled a step)
  local after; after=$(awk '/ready in/ {r=1} r && /triton compiled/ {n++} END {print n+0}' "$OUT/server_$1.tmp")
  echo "== $1: $after Triton compiles after ready" | tee -a "$OUT/compiles.txt"
  echo "#### server $1" >> "$OUT/server.log"; cat "$OUT/server_$1.tmp" >> "$OUT/server.log"; rm -f "$OUT/server_$1.tmp"
}

# API_COUNTS="1 2 4": one server per --api-server-count (default: today's single API process)
if [ -n "${API_COUNTS:-}" ]; then
  for n in $API_COUNTS; do serve_and_bench "api-servers-$n" "--api-server-count $n"; done
else
  serve_and_bench engine-process ""
fi
[ "${AB:-0}" = 1 ] && serve_and_bench engine-thread "--no-engine-process"
# CEILING="4 8": each client against a stand-in server that costs nothing (benchmarks/client_ceiling.py:
# a step clock of that many ms over at most 256 streams), so the rate each client can measure on this
# host shows beside the servers' rows; JSON lines in $OUT/client_ceiling.jsonl
for step in ${CEILING:-}; do
  for c in pagedllm $([ -n "$VB" ] && echo vllm); do
    timeout 120 $PY benchmarks/client_ceiling.py --client $c --vllm-bench "${VB:-.}" --tokenizer $MODEL \
        --num-prompts $NUM --input-len $IN --output-len $OUTLEN --step-ms $step --out "$OUT/client_ceiling.jsonl" \
        2>&1 | tail -1 | cut -c1-300
  done
done
$PY - "$OUT/results/serving-gpu.json" "$OUT/vllm-client" <<'EOF'
import glob, json, os, sys
for r in json.load(open(sys.argv[1])):
    s = r["results"]
    print(f"{r['label'][:60]:<60} {s['request_throughput']:>7.1f} req/s  TTFT med {s['median_ttft_ms']:>8.1f} ms  "
          f"TPOT med {s['median_tpot_ms']:>6.2f} ms  failed {s['failed']}")
for path in sorted(glob.glob(os.path.join(sys.argv[2], "*.json")), key=os.path.getmtime):
    s = json.load(open(path))
    label = f"vLLM client: {s.get('server', '?')}; {s['request_rate']} req/s"
    print(f"{label[:60]:<60} {s['request_throughput']:>7.1f} req/s  TTFT med {s['median_ttft_ms']:>8.1f} ms  "
          f"TPOT med {s['median_tpot_ms']:>6.2f} ms  failed {s['num_prompts'] - s['completed']}")
EOF
ls "$OUT"
