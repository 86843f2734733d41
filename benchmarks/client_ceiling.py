"""How many requests per second a serving benchmark's client can measure at all: the client
against a stand-in server that costs nothing, so the client's own limits show.

The stand-in answers `/v1/completions` as an engine under load would look from outside, at no
cost: every `--step-ms` it sends one token (one SSE event) to each of at most `--batch` running
streams, admitted in arrival order, `--output-len` tokens a request, then the usage event and
`[DONE]`. A client that costs nothing measures the ideal rate,
N / (ceil(N / batch) x output_len x step) with every request sent at once; what it measures
below that is its own time: opening connections, sending, parsing events on one event loop.
`--client vllm` runs vLLM's `benchmark_serving.py` (`--vllm-bench DIR`: scripts/serving_gpu_check.sh
carries v0.9.2 under .whl/vclient/vllm_bench), `--client pagedllm` this project's
`pagedllm bench serve`, on the serving workload (random prompts, all at once). The client's CPU
time comes from its own rusage.

    python benchmarks/client_ceiling.py --client vllm --vllm-bench .whl/vclient/vllm_bench \
        --step-ms 8 --batch 256 --num-prompts 500 --out FILE

(On this project's 2-core CPU box, 2026-12-04, benchmarks/results/api_cpu/client-ceiling-cpu.jsonl:
vLLM's client measured 250 / 170 / 95 req/s at 4 / 8 / 16 ms steps where the ideal is 488 / 244 /
122, about 1 s of its own per 500 requests. The GPU host's own rows are what bound the serving
rows measured there: CEILING="4 8" bash scripts/serving_gpu_check.sh.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import socket
import subprocess
import sys
import time

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(obj: dict) -> bytes:
    return chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")


class StepServer:
    """The stand-in engine: a step clock over the admitted streams (asyncio, one process)."""

    def __init__(self, output_len: int, batch: int, step_s: float, model: str):
        def token(i: int) -> bytes:
            last = i == output_len - 1
            choice = {"index": 0, "text": " tok", "logprobs": None, "finish_reason": "length" if last else None}
            return event(
                {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": model, "choices": [choice]}
            )

        usage = {"prompt_tokens": 0, "completion_tokens": output_len, "total_tokens": output_len}
        tail = event(
            {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": model, "choices": [], "usage": usage}
        )
        self.events = [token(i) for i in range(output_len)]
        self.events[-1] += tail + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.models = json.dumps({"object": "list", "data": [{"id": model, "object": "model"}]}).encode()
        self.batch, self.step_s = batch, step_s
        self.waiting: list[tuple[asyncio.StreamWriter, asyncio.Future[None]]] = []
        self.running: list[list] = []  # [writer, done future, next token]

    async def clock(self) -> None:
        while True:
            start = time.monotonic()
            while self.waiting and len(self.running) < self.batch:
                writer, done = self.waiting.pop(0)
                writer.write(HEAD)
                self.running.append([writer, done, 0])
            for r in self.running:
                r[0].write(self.events[r[2]])
                r[2] += 1
            for r in [r for r in self.running if r[2] == len(self.events)]:
                self.running.remove(r)
                r[1].set_result(None)
            await asyncio.sleep(max(0.0, self.step_s - (time.monotonic() - start)))

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                if length:
                    await reader.readexactly(int(length.group(1)))
                if head.startswith(b"GET"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
                    writer.write(b"content-length: %d\r\n\r\n%s" % (len(self.models), self.models))
                    continue
                done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self.waiting.append((writer, done))
                await done
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def serve(self, sock: socket.socket) -> None:
        server = await asyncio.start_server(self.handle, sock=sock, backlog=4096)
        asyncio.get_running_loop().create_task(self.clock())
        await server.serve_forever()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--client", choices=["vllm", "pagedllm"], default="vllm")
    ap.add_argument("--vllm-bench", default=".whl/vclient/vllm_bench", help="directory of benchmark_serving.py")
    ap.add_argument("--client-python", default=sys.executable, help="the Python that runs the client")
    ap.add_argument("--tokenizer", default=None, help="the clients' tokenizer (default: the bundled model)")
    ap.add_argument("--num-prompts", type=int, default=500)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=256, help="streams the stand-in runs at once (max_num_seqs)")
    ap.add_argument("--step-ms", type=float, default=8.0)
    ap.add_argument("--serve-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="append the result as one JSON line")
    args = ap.parse_args()
    if args.serve_only:  # the stand-in, in a process of its own
        sock = socket.socket()
        sock.bind(("127.0.0.1", args.port))
        asyncio.run(StepServer(args.output_len, args.batch, args.step_ms / 1000, "m").serve(sock))
        return 0
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import pagedllm
    from pagedllm.bench.common import append_json_line, environment
    from pagedllm.bench.server_process import free_port

    tokenizer = args.tokenizer or str(pagedllm.default_model_path())
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve-only", "--port", str(port), "--output-len", str(args.output_len)]
        + ["--batch", str(args.batch), "--step-ms", str(args.step_ms)]
    )
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except OSError:
                time.sleep(0.1)
        base = f"http://127.0.0.1:{port}"
        if args.client == "vllm":
            cmd = [args.client_python, os.path.join(args.vllm_bench, "benchmark_serving.py"), "--backend", "openai"]
            cmd += ["--base-url", base, "--endpoint", "/v1/completions", "--model", "m", "--tokenizer", tokenizer]
            cmd += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
            cmd += ["--random-output-len", str(args.output_len), "--ignore-eos", "--disable-tqdm", "--seed", "1"]
        else:
            cmd = [args.client_python, "-m", "pagedllm", "bench", "serve", "--base-url", base, "--model", tokenizer]
            cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len), "--seed", "1"]
            cmd += ["--no-save"]  # its rows against a stand-in belong in this script's output only
        cmd += ["--num-prompts", str(args.num_prompts), "--request-rate", "inf"]
        client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert client.stdout is not None
        text = client.stdout.read()
        _, status, usage = os.wait4(client.pid, 0)  # the client's own CPU time
        client.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    finally:
        server.terminate()
        server.wait()
    rate = re.search(r"Request throughput \(req/s\):\s*([\d.]+)", text)
    duration = re.search(r"(?i)Benchmark duration \(s\):\s*([\d.]+)", text)
    ideal_s = math.ceil(args.num_prompts / args.batch) * args.output_len * args.step_ms / 1000
    out = {
        "benchmark": "client_ceiling",
        "client": args.client,
        "client_version": open(os.path.join(args.vllm_bench, "VERSION")).read().strip()
        if args.client == "vllm" and os.path.exists(os.path.join(args.vllm_bench, "VERSION"))
        else "pagedllm",
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "batch": args.batch,
        "step_ms": args.step_ms,
        "ideal_req_s": round(args.num_prompts / ideal_s, 1),
        "measured_req_s": float(rate.group(1)) if rate else None,
        "measured_duration_s": float(duration.group(1)) if duration else None,
        "client_overhead_s": round(float(duration.group(1)) - ideal_s, 3) if duration else None,
        "client_cpu_s": round(usage.ru_utime + usage.ru_stime, 2),  # start-up (imports, dataset) included
        **environment(),
    }
    print(json.dumps(out))
    if rate is None:
        print(text[-3000:], file=sys.stderr)
    append_json_line(out, args.out)
    return 0 if rate else 1


if __name__ == "__main__":
    sys.exit(main())
