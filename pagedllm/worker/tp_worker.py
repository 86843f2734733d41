"""A tensor-parallel rank other than 0: build the same ModelRunner (its own slice of the
weights, its own KV heads, the same block ids) and run every step rank 0 sends until told
to stop. Rank 0 alone samples; the others take part in the forward's collectives only.

An exception on a worker is written to the process group's store under ERROR_KEY/<rank>
before the worker exits, so that rank 0 (whose collective then fails) can name the rank and
show the traceback.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

CLOSE = "close"
ERROR_KEY = "pagedllm/tp/error"
JOINED_KEY = "pagedllm/tp/joined"


def make_runner(hf_config, model_dir: str, local_rank: int, runner_kwargs: dict):
    """This rank's ModelRunner; on GPU rank r of a host uses cuda:<local_rank>."""
    from pagedllm.worker.model_runner import ModelRunner

    kwargs = dict(runner_kwargs)
    if kwargs["device"].type == "cuda":
        kwargs["device"] = torch.device("cuda", local_rank)
        torch.cuda.set_device(kwargs["device"])
    return ModelRunner(hf_config, model_dir, **kwargs)


def serve(runner, channel) -> None:
    """The worker loop: one message per step, the same forward as rank 0."""
    while True:
        msg = channel.recv()
        if isinstance(msg, str) and msg == CLOSE:
            return
        runner.run(msg)


def report_error(store, rank: int) -> None:
    text = traceback.format_exc()
    sys.stderr.write(f"[pagedllm tensor-parallel rank {rank}] {text}")
    try:
        store.set(f"{ERROR_KEY}/{rank}", text)
    except Exception:
        pass


def exit_when_orphaned(parent_pid: int, interval_s: float = 0.5) -> None:
    """Belt and braces for a worker blocked in a collective when its parent dies: a pipe's EOF
    only wakes a worker that is waiting on the pipe."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="pagedllm-parent-watch", daemon=True).start()


def spawned_worker_main(
    rank: int,
    world_size: int,
    store_port: int,
    backend: str,
    timeout_s: float,
    hf_config,
    model_dir: str,
    runner_kwargs: dict,
    reader,
    parent_pid: int,
) -> None:
    """Entry point of a worker process started by TPExecutor on this host."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it closes us
    exit_when_orphaned(parent_pid)
    if runner_kwargs["device"].type == "cuda":
        torch.cuda.set_device(rank)  # before NCCL sees this process
    else:  # share the host's cores among the ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, timeout=timeout)
    try:
        store.set(f"{JOINED_KEY}/{rank}", "1")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        runner = make_runner(hf_config, model_dir, rank, runner_kwargs)
        serve(runner, reader)
    except EOFError:  # rank 0's process is gone
        os._exit(1)
    except BaseException:
        report_error(store, rank)
        os._exit(1)
    reader.close()
    dist.destroy_process_group()
