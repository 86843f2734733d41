"""Per-step cost of shipping StepInputs from rank 0 to a tensor-parallel worker (CPU only).

    python benchmarks/tp_channel.py [--batch 256] [--context 1024] [--block-size 16]

A decode step of `batch` sequences at `context` tokens each (block tables [batch, context /
block_size]). For each channel: `send` = rank 0's host time per step (what the engine pays),
`round trip` = send until the worker has the unpickled StepInputs and has acknowledged
through a pipe (an upper bound on the latency the worker adds before its forward).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from datetime import timedelta

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def decode_inputs(batch: int, context: int, block_size: int):
    from pagedllm.worker.step_inputs import StepInputs

    nb = -(-context // block_size)
    bt = np.arange(batch * nb, dtype=np.int32).reshape(batch, nb)
    pos = np.full(batch, context - 1, dtype=np.int64)
    return StepInputs(
        input_ids=np.random.randint(0, 150000, batch).astype(np.int64),
        positions=pos,
        slot_mapping=bt[:, -1].astype(np.int64) * block_size + (context - 1) % block_size,
        block_tables=bt,
        cu_seqlens_q=np.arange(batch + 1, dtype=np.int32),
        seq_lens=np.full(batch, context, dtype=np.int32),
        logits_indices=np.arange(batch, dtype=np.int64),
        max_seqlen_q=1,
        max_seqlen_k=context,
        decode_only=True,
        no_history=False,
        blocks_to_copy=[],
        seq_ids=list(range(batch)),
        sample_seq_ids=list(range(batch)),
        temperature=np.full(batch, 0.6, np.float32),
        top_k=np.full(batch, 151936, np.int64),
        top_p=np.ones(batch, np.float32),
        min_p=np.zeros(batch, np.float32),
        seeds=[None] * batch,
    )


def _worker(kind, reader, ack, port, steps):
    import torch.distributed as dist

    if kind == "shm":
        recv = reader.recv
    else:
        from pagedllm.worker.tp_channel import BroadcastChannel

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2, timeout=timedelta(seconds=60)
        )
        ch = BroadcastChannel()
        recv = ch.recv
        if kind == "object_list":

            def recv():
                box = [None]
                dist.broadcast_object_list(box, src=0, group=ch.group)
                return box[0]

    for _ in range(steps):
        inp = recv()
        assert inp.num_seqs > 0
        ack.send_bytes(b"k")
    if kind != "shm":
        dist.destroy_process_group()


def measure(kind: str, inp, steps: int) -> dict:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from pagedllm.worker.tp_channel import BroadcastChannel, ShmChannel

    ctx = mp.get_context("spawn")
    ack_r, ack_w = ctx.Pipe(duplex=False)
    port = 29500 + os.getpid() % 1000
    reader = None
    if kind == "shm":
        ch = ShmChannel(1, ctx)
        reader = ch.reader(0)
    p = ctx.Process(target=_worker, args=(kind, reader, ack_w, port, steps), daemon=True)
    p.start()
    if kind == "shm":
        ch.started()
        send = ch.send
    else:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2, timeout=timedelta(seconds=60)
        )
        ch = BroadcastChannel()
        send = ch.send
        if kind == "object_list":

            def send(obj):
                dist.broadcast_object_list([obj], src=0, group=ch.group)

    sends, trips = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        send(inp)
        t1 = time.perf_counter()
        ack_r.recv_bytes()
        t2 = time.perf_counter()
        sends.append(t1 - t0)
        trips.append(t2 - t0)
    p.join()
    if kind == "shm":
        ch.close()
    else:
        dist.destroy_process_group()
    warm = steps // 10
    return {
        "channel": kind,
        "send_us_median": 1e6 * statistics.median(sends[warm:]),
        "round_trip_us_median": 1e6 * statistics.median(trips[warm:]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args()
    inp = decode_inputs(args.batch, args.context, args.block_size)
    n = 200
    t = time.perf_counter()
    for _ in range(n):
        data = pickle.dumps(inp, protocol=pickle.HIGHEST_PROTOCOL)
    pickle_us = 1e6 * (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n):
        pickle.loads(data)
    unpickle_us = 1e6 * (time.perf_counter() - t) / n
    rows = [measure(k, inp, args.steps) for k in ("shm", "broadcast", "object_list")]
    row = {
        "benchmark": "tp_channel",
        "batch": args.batch,
        "context": args.context,
        "block_size": args.block_size,
        "message_bytes": len(data),
        "pickle_us": pickle_us,
        "unpickle_us": unpickle_us,
        "channels": rows,
    }
    print(json.dumps(row, indent=1))
    if not args.no_save:
        from pagedllm.bench.common import append_result, environment

        row.update(environment(), loadavg=os.getloadavg())
        print("appended to", append_result(row, args.results_dir, "tp-channel-cpu"))


if __name__ == "__main__":
    main()
