"""TPExecutor: tensor parallelism over torch.distributed, behind the engine's Executor
protocol (engine/executor.py): `num_kv_blocks`, `execute(SchedulerOutput) -> StepResult`,
`close()`; `supports_async` is False (every rank must run each step in turn).

Rank 0 lives in the engine's process: the scheduler and the KV-cache manager stay there, so
block ids and prefix-cache hashes have one owner. Every rank holds 1/N of the weights and
the KV of 1/N of the KV heads (KV heads are split, never replicated) in a pool indexed by the
same block ids, so rank 0's block tables are valid on every rank. Per step rank 0 builds the
StepInputs once, ships them (tp_channel), and all ranks run the same forward; the row-
parallel layers all-reduce and the LM head all-gathers the logits. Rank 0 alone samples.

Two ways to start:
- one host (default): rank 0 spawns N-1 worker processes and hosts the TCPStore on a free
  127.0.0.1 port; NCCL on cuda:<rank> or gloo on CPU.
- several hosts: under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set, WORLD_SIZE == N) every
  process runs `LLM(...)`; rank 0's returns as usual, the others run steps inside the
  constructor and exit the process (SystemExit(0)) when rank 0 closes.

Failure: a worker that raises writes its traceback to the store and exits; rank 0 checks its
workers are alive before each step and, when a step fails, raises a RuntimeError naming the
rank. Collectives carry a timeout (PAGEDLLM_TP_TIMEOUT_S, envs.py, default 300 s) so that a
live but stuck rank cannot hang rank 0 forever.
"""

from __future__ import annotations

import atexit
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import weakref
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pagedllm import envs
from pagedllm.engine.executor import StepHandle
from pagedllm.engine.kv_cache_groups import KVCacheGroup
from pagedllm.engine.scheduler_output import SchedulerOutput
from pagedllm.engine.step_result import StepResult
from pagedllm.model.moe import check_tp as check_moe_tp
from pagedllm.model.registry import resolve
from pagedllm.worker.step_inputs import StepInputs
from pagedllm.worker.tp_channel import BroadcastChannel, ShmChannel
from pagedllm.worker.tp_worker import (
    CLOSE,
    ERROR_KEY,
    JOINED_KEY,
    exit_when_orphaned,
    make_runner,
    report_error,
    serve,
    spawned_worker_main,
)

if TYPE_CHECKING:
    from pagedllm.worker.model_runner import ModelRunner


def check_divisible(hf_config, n: int) -> None:
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    inter = hf_config.intermediate_size
    if heads % n or kv_heads % n or inter % n:
        raise ValueError(
            f"tensor_parallel_size={n} must divide num_attention_heads ({heads}), num_key_value_heads "
            f"({kv_heads}) and intermediate_size ({inter}) of this model; KV heads are split across "
            f"ranks, not replicated, so tensor_parallel_size can be at most {kv_heads}"
        )
    check_moe_tp(hf_config, resolve(hf_config).moe, n)  # the experts' intermediate size too


def torchrun_env(n: int) -> tuple[int, int] | None:
    """(rank, local_rank) when this process was started by torchrun for a group of n."""
    launched = envs.torchrun()
    if launched is None:
        return None
    rank, world, local_rank = launched
    if world == 1:
        return None
    if world != n:
        raise ValueError(
            f"started by torchrun with WORLD_SIZE={world} but tensor_parallel_size={n}: "
            "launch one process per tensor-parallel rank (e.g. --nproc-per-node)"
        )
    return rank, local_rank


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _close_at_exit(ref) -> None:
    executor = ref()
    if executor is not None:
        executor.close()


class TPExecutor:
    supports_async = False  # every rank runs each step in turn: no launch-ahead under TP yet

    def __init__(self, hf_config, model_dir: str, tensor_parallel_size: int, **runner_kwargs):
        n = tensor_parallel_size
        check_divisible(hf_config, n)
        self.world_size = n
        self.procs: list[BaseProcess] = []
        self.channel: ShmChannel | BroadcastChannel | None = None
        self.store: dist.Store | None = None
        self._driver: ModelRunner | None = None  # rank 0's ModelRunner, once built
        self.rank = 0
        self.failed: BaseException | None = None
        self.closed = False
        self._owns_group = False
        self._monitor_stop: multiprocessing.connection.Connection | None = None
        device: torch.device = runner_kwargs["device"]
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.timeout = timedelta(seconds=envs.tp_timeout_s())
        ref = weakref.ref(self)
        self._atexit = lambda: _close_at_exit(ref)
        atexit.register(self._atexit)
        launched = torchrun_env(n)
        try:
            if launched is None:
                self._spawn(hf_config, model_dir, runner_kwargs)
            else:
                self._join_torchrun(hf_config, model_dir, runner_kwargs, *launched)
        except BaseException as e:
            err = self._explain(e)
            self.close()
            if err is e:
                raise
            raise err from e

    # ---- start-up ----------------------------------------------------------------------
    def _spawn(self, hf_config, model_dir, runner_kwargs) -> None:
        n = self.world_size
        if dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed process group already exists in this process (is another "
                "tensor-parallel LLM still open? close it first)"
            )
        if self.backend == "nccl" and torch.cuda.device_count() < n:
            raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs on this host, found {torch.cuda.device_count()}")
        ctx = torch.multiprocessing.get_context("spawn")
        store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, timeout=self.timeout, wait_for_workers=False)
        self.store = store
        channel = self.channel = ShmChannel(n - 1, ctx)
        for rank in range(1, n):
            p = ctx.Process(
                target=spawned_worker_main,
                name=f"pagedllm-tp-rank{rank}",
                daemon=True,
                args=(
                    rank,
                    n,
                    store.port,
                    self.backend,
                    self.timeout.total_seconds(),
                    hf_config,
                    model_dir,
                    runner_kwargs,
                    channel.reader(rank - 1),
                    os.getpid(),
                ),
            )
            p.start()
            self.procs.append(p)
        channel.started()
        self._wait_for_workers_to_join(store)
        if self.backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(self.backend, store=store, rank=0, world_size=n, timeout=self.timeout)
        self._owns_group = True
        self._driver = make_runner(hf_config, model_dir, 0, runner_kwargs)
        if self.backend == "nccl":
            self._start_monitor()

    def _wait_for_workers_to_join(self, store: dist.Store) -> None:
        """Wait (checking that they live) until every worker has imported torch and reached the
        rendezvous, so that init_process_group cannot wait out its timeout on a dead worker."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        keys = [f"{JOINED_KEY}/{r}" for r in range(1, self.world_size)]
        while not store.check(keys):
            err = self._worker_failure()
            if err is not None:
                raise err
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within {self.timeout}")
            time.sleep(0.02)

    def _join_torchrun(self, hf_config, model_dir, runner_kwargs, rank: int, local_rank: int) -> None:
        if rank != 0:
            exit_when_orphaned(os.getppid())  # torchrun's agent gone: so are we
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise ValueError(
                    f"the process group has {dist.get_world_size()} ranks, tensor_parallel_size is {self.world_size}"
                )
        else:
            if self.backend == "nccl":
                torch.cuda.set_device(local_rank)
            dist.init_process_group(self.backend, init_method="env://", timeout=self.timeout)
            self._owns_group = True
        self.rank = rank
        store = self.store = dist.distributed_c10d._get_default_store()
        channel = self.channel = BroadcastChannel()
        if rank == 0:
            self._driver = make_runner(hf_config, model_dir, local_rank, runner_kwargs)
            return
        # a worker: serve rank 0 until it closes, then leave the process
        try:
            runner = make_runner(hf_config, model_dir, local_rank, runner_kwargs)
            serve(runner, channel)
            channel.barrier()
        except BaseException:
            report_error(store, rank)
            self.closed = True
            raise
        self.closed = True
        if self._owns_group:
            dist.destroy_process_group()
        sys.exit(0)

    def _start_monitor(self) -> None:
        """NCCL waits on a dead peer without end: when a worker dies, abort the communicators so
        that rank 0's pending collective returns and the step can fail with the rank named."""
        r, w = multiprocessing.Pipe(duplex=False)
        self._monitor_stop = w

        def watch():
            ready = multiprocessing.connection.wait([p.sentinel for p in self.procs] + [r])
            if r in ready or self.closed:
                return
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception:
                pass

        threading.Thread(target=watch, name="pagedllm-tp-monitor", daemon=True).start()

    # ---- failures ----------------------------------------------------------------------
    def _worker_failure(self) -> RuntimeError | None:
        """What went wrong on a worker, if anything did: its reported traceback, else its death."""
        if self.store is not None:
            for rank in range(1, self.world_size):
                key = f"{ERROR_KEY}/{rank}"
                try:
                    if self.store.check([key]):
                        text = self.store.get(key).decode(errors="replace").rstrip()
                        return RuntimeError(f"tensor-parallel worker rank {rank} failed:\n{text}")
                except Exception:
                    break  # the store went away with rank 0 of torchrun
        for rank, p in enumerate(self.procs, 1):
            if p.exitcode is not None and not self.closed:
                return RuntimeError(
                    f"tensor-parallel worker rank {rank} (pid {p.pid}) died ({_describe_exit(p.exitcode)})"
                )
        return None

    def _explain(self, e: BaseException, grace_s: float = 3.0) -> BaseException:
        """For a communication error (a failed collective or pipe is usually the echo of a worker
        dying), the worker's failure once it shows; else e itself."""
        if not isinstance(e, (RuntimeError, OSError)) or (not self.procs and self.store is None):
            return e
        deadline = time.monotonic() + grace_s
        while True:
            err = self._worker_failure()
            if err is not None:
                return err
            if time.monotonic() >= deadline:
                if not self.procs and self.failed is None:  # torchrun: no process to look at
                    return RuntimeError(f"a tensor-parallel collective failed (did a rank die?): {e}")
                return e
            time.sleep(0.05)

    def _check_alive(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"the tensor-parallel group has shut down after an earlier error: {self.failed}")
        if self.closed:
            raise RuntimeError("the tensor-parallel executor is closed")
        for rank, p in enumerate(self.procs, 1):
            if p.exitcode is not None:
                raise self._fail(RuntimeError(f"tensor-parallel worker rank {rank} exited"))

    def _fail(self, e: BaseException) -> BaseException:
        err = self._explain(e)
        self.failed = err
        self.close()
        return err

    # ---- the executor interface --------------------------------------------------------
    @property
    def driver(self) -> ModelRunner:
        """Rank 0's ModelRunner (weights slice, KV heads, CUDA graphs, sampling)."""
        if self._driver is None:
            raise RuntimeError("the tensor-parallel executor has no rank-0 runner (not started, or not rank 0)")
        return self._driver

    @property
    def device(self) -> torch.device:
        """Rank 0's device (cuda:<local rank> on GPU)."""
        return self.driver.device

    @property
    def num_kv_blocks(self) -> int:
        return self.driver.num_kv_blocks  # the same on every rank (agree_min)

    @property
    def num_host_kv_blocks(self) -> int:
        return self.driver.num_host_kv_blocks  # the same on every rank (agree_min): each holds its shard

    @property
    def block_bytes(self) -> int:
        return self.driver.block_bytes  # one rank's share of a block

    @property
    def kv_cache_dtype(self) -> str:
        return self.driver.kv_cache_dtype  # the same on every rank, as are the fp8 scales (agree_max)

    @property
    def kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        return self.driver.kv_cache_groups  # from the config's layers: the same on every rank

    def execute(self, scheduler_output: SchedulerOutput) -> StepResult:
        return self.run(self.driver.step_inputs(scheduler_output))

    def execute_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        raise NotImplementedError("TPExecutor.supports_async is False: use execute")

    def run(self, inp: StepInputs) -> StepResult:
        self._check_alive()
        assert self.channel is not None
        try:
            self.channel.send(inp)
            return self.driver.run(inp)
        except BaseException as e:
            err = self._fail(e)
            if err is e:
                raise
            raise err from e

    def close(self) -> None:
        """Stop the workers (they leave their loop and exit) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self._atexit)
        if self._monitor_stop is not None:
            self._monitor_stop.close()
        if self.channel is not None and self._driver is not None and self.failed is None and self.rank == 0:
            try:
                self.channel.send(CLOSE)
                if isinstance(self.channel, BroadcastChannel):
                    self.channel.barrier()
            except Exception:
                pass
        if self._owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if self.channel is not None:
            self.channel.close()
        self.store = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
