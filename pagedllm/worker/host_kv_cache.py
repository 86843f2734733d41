"""The host tier's KV buffer (engine/host_tier.py decides, this copies): `num_blocks` blocks of
the device KV tensor's dtype (fp8 included) and block contents, every KV-cache group's layer
slots. Pinned memory on CUDA (copies run without the host waiting), a lazily zeroed mapping on
CPU (the same logic over two host buffers, so CI runs it). Under tensor parallelism every rank
holds its own shard's KV heads of the same host block ids.

Layout: [num_blocks, 2 (K, V), layer slots, Hkv, block_size, D], block-major, so that one host
block, and a run of consecutive host blocks (the tier hands out never-used blocks in id order),
is one contiguous transfer. Block b of the device tensor [2, slots, N, Hkv, block_size, D] is
the strided slice kv[:, :, b].

Order (the scheduler's SchedulerOutput says why): a step's offloads, then its loads, then its
copy-on-write copies and forward. Three streams on CUDA: the current one (the forward), an offload
stream (device to host) and a load stream (host to device), so the two directions of PCIe run at
once and beside the forward.
- Offload (device to host): the evicted blocks are gathered on the device into a staging
  tensor, on the current stream, in the step's order (a device copy: far faster than PCIe); the
  PCIe transfer into pinned memory then runs on the offload stream while the step's forward
  overwrites the blocks. Past STAGING_BYTES of staging per step, the rest goes over PCIe on the
  current stream (bounded device memory, the same order). The offload stream first waits for
  the load stream's last load, so a transfer never writes a host block that a load still reads.
- Load (host to device), on the load stream, after everything queued so far on the current stream
  (its destination blocks were free: the step's offloads, or a finished step, may still read
  them), and after the offloads still in flight that write any of its host blocks.
  - `load(pairs)`: blocks this step's forward reads; the current stream waits for them at once.
  - `load(pairs, prefetch)`: then the blocks of sequences admitted for the next step
    (engine/scheduler.py); the forward runs beside them and `begin_step` makes the next step's
    current stream wait for them before anything else (its offloads may read those blocks).
"""

from __future__ import annotations

import logging
import time

import torch

from pagedllm.ops.kv_quant import bytes_view
from pagedllm.worker.step_handle import LoadTime

logger = logging.getLogger("pagedllm")

STAGING_BYTES = 256 << 20  # device memory an offload may hold while its PCIe transfer drains


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position, first id, length) of each run of consecutive ids: ids[i + k] == ids[i] + k."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            p, first, n = runs[-1]
            runs[-1] = (p, first, n + 1)
        else:
            runs.append((i, b, 1))
    return runs


class HostKVCache:
    def __init__(self, kv: torch.Tensor, num_blocks: int) -> None:
        """kv: the device KV tensor [2, slots, N, Hkv, block_size, D]. Raises RuntimeError when the
        host cannot allocate (or pin) the buffer."""
        from pagedllm.worker.device import zeroed_host_bytes

        self.kv = kv
        self.num_blocks = num_blocks
        two, slots, _, heads, bs, dim = kv.shape
        shape = (num_blocks, two, slots, heads, bs, dim)
        nbytes = num_blocks * two * slots * heads * bs * dim * kv.element_size()
        self.on_cuda = kv.is_cuda
        if self.on_cuda:
            raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            raw = zeroed_host_bytes(nbytes)
        self.host = raw.view(kv.dtype).view(shape)
        self.nbytes = nbytes
        self.stream = torch.cuda.Stream(kv.device) if self.on_cuda else None  # offloads (device to host)
        self.load_stream = torch.cuda.Stream(kv.device) if self.on_cuda else None
        # offload batches whose transfer may still be in flight: (done event, the host blocks it writes)
        self._offloading: list[tuple[torch.cuda.Event, set[int]]] = []
        self._loaded = torch.cuda.Event() if self.on_cuda else None  # the load stream's last load (recorded: no wait)
        self._prefetched: torch.cuda.Event | None = None  # prefetch loads the next step must wait for

    def _device_blocks(self) -> torch.Tensor:
        """The device tensor as [N, 2, slots, Hkv, block_size, D] (a strided view, uint8 for fp8)."""
        return bytes_view(self.kv).permute(2, 0, 1, 3, 4, 5)

    def _ids(self, ids: list[int]) -> torch.Tensor:
        t = torch.tensor(ids, dtype=torch.int64)
        return t.to(self.kv.device, non_blocking=True) if self.on_cuda else t

    def begin_step(self) -> None:
        """Before a step's first copy or forward: the current stream waits for the loads the last
        step prefetched (their sequences run now, and this step's offloads may read those blocks)."""
        if self._prefetched is not None:
            torch.cuda.current_stream(self.kv.device).wait_event(self._prefetched)
            self._prefetched = None

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device block g into host block h for each (g, h); a host block named twice ends
        with the later copy (the list's order)."""
        if not pairs:
            return
        last = {h: g for g, h in pairs}  # the later write to a host block wins
        order = sorted(last)
        gpu = [last[h] for h in order]
        dev, host = self._device_blocks(), bytes_view(self.host)
        if not self.on_cuda:
            host.index_copy_(0, torch.tensor(order), dev.index_select(0, torch.tensor(gpu)))
            return
        assert self.stream is not None and self._loaded is not None
        per_block = self.nbytes // self.num_blocks
        staged = max(1, STAGING_BYTES // per_block)
        main = torch.cuda.current_stream(self.kv.device)
        self._offloading = [(e, ids) for e, ids in self._offloading if not e.query()]
        for start in range(0, len(order), staged):
            chunk = slice(start, start + staged)
            snapshot = dev.index_select(0, self._ids(gpu[chunk]))  # on the current stream, in order
            side = start == 0  # the first STAGING_BYTES drain beside the forward; the rest here
            stream = self.stream if side else main
            if side:
                self.stream.wait_stream(main)
                self.stream.wait_event(self._loaded)  # no host block is written while a load reads it
                snapshot.record_stream(self.stream)
            with torch.cuda.stream(stream):
                for pos, first, n in _runs(order[chunk]):
                    host[first : first + n].copy_(snapshot[pos : pos + n], non_blocking=True)
            if side:
                done = torch.cuda.Event()
                done.record(self.stream)
                self._offloading.append((done, set(order[chunk])))

    def load(self, pairs: list[tuple[int, int]], prefetch: list[tuple[int, int]] | tuple = ()) -> LoadTime:
        """Copy host block h into device block g for each (h, g): first `pairs`, which this step
        reads (the current stream waits for them at once), then `prefetch`, which the next step
        reads (its `begin_step` waits for them). Returns the seconds it took on CPU; on CUDA a
        pair of events around the copies on the load stream (read once they are done)."""
        if not pairs and not prefetch:
            return 0.0
        t0 = time.perf_counter()
        if not self.on_cuda:
            self._copy_in(pairs)
            self._copy_in(prefetch)
            return time.perf_counter() - t0
        assert self.load_stream is not None
        main = torch.cuda.current_stream(self.kv.device)
        self.load_stream.wait_stream(main)
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._after_offloads(pairs if pairs else prefetch)
        began.record(self.load_stream)
        self._copy_in(pairs)
        if pairs:
            read_now = torch.cuda.Event()
            read_now.record(self.load_stream)
            main.wait_event(read_now)
            self._after_offloads(prefetch)
        self._copy_in(prefetch)
        ended.record(self.load_stream)
        self._loaded = ended
        if prefetch:
            self._prefetched = ended
        return (began, ended)

    def _after_offloads(self, pairs: list[tuple[int, int]] | tuple) -> None:
        """The load stream waits for the in-flight offloads that write any of these host blocks."""
        assert self.load_stream is not None
        wanted = {h for h, _ in pairs}
        for done, written in self._offloading:
            if written & wanted:  # a host block whose offload may still be in flight
                self.load_stream.wait_event(done)

    def _copy_in(self, pairs: list[tuple[int, int]] | tuple) -> None:
        """The copies of `load`: queued on the load stream (CUDA), or run at once (CPU)."""
        if not pairs:
            return
        ids = [h for h, _ in pairs]
        dev, host = self._device_blocks(), bytes_view(self.host)
        if not self.on_cuda:
            dev.index_copy_(0, torch.tensor([g for _, g in pairs]), host.index_select(0, torch.tensor(ids)))
            return
        staged = max(1, STAGING_BYTES // (self.nbytes // self.num_blocks))
        with torch.cuda.stream(self.load_stream):
            for start in range(0, len(pairs), staged):
                chunk = pairs[start : start + staged]
                staging = torch.empty((len(chunk), *host.shape[1:]), dtype=host.dtype, device=self.kv.device)
                for pos, first, n in _runs([h for h, _ in chunk]):
                    staging[pos : pos + n].copy_(host[first : first + n], non_blocking=True)
                dev.index_copy_(0, self._ids([g for _, g in chunk]), staging)

    def close(self) -> None:
        """Let go of the buffer (pinned memory goes back to the driver when the last view does)."""
        if self.on_cuda and self.stream is not None and self.load_stream is not None:
            self.stream.synchronize()
            self.load_stream.synchronize()
        del self.host


def host_kv_blocks(kv_offloading_size: float, block_bytes: int, world_size: int) -> int:
    """Host blocks that kv_offloading_size GiB holds (summed over the tensor-parallel ranks, as
    vLLM's flag: each rank pins its share). Refuses, naming the option, a negative size, a size
    too small for one block, and one larger than the host's available memory."""
    from pagedllm.engine.errors import InvalidRequestError
    from pagedllm.worker.device import GiB, available_ram_bytes

    if not kv_offloading_size >= 0:  # also NaN
        raise InvalidRequestError(
            f"kv_offloading_size must be >= 0 GiB (0: no host tier), got {kv_offloading_size}", "kv_offloading_size"
        )
    total = int(kv_offloading_size * GiB)
    if total == 0:
        return 0
    available = available_ram_bytes()
    if total > available:
        raise InvalidRequestError(
            f"kv_offloading_size {kv_offloading_size} GiB is more than this host can pin: "
            f"{available / GiB:.2f} GiB of memory is available",
            "kv_offloading_size",
        )
    blocks = total // world_size // block_bytes
    if blocks == 0:
        raise InvalidRequestError(
            f"kv_offloading_size {kv_offloading_size} GiB holds no KV block ({block_bytes * world_size} bytes "
            "over every rank): give 0 (no host tier) or more",
            "kv_offloading_size",
        )
    return blocks


def allocate_host_kv_cache(kv: torch.Tensor, num_blocks: int) -> HostKVCache:
    """The buffer, or InvalidRequestError naming kv_offloading_size when the host cannot pin it."""
    from pagedllm.engine.errors import InvalidRequestError
    from pagedllm.worker.device import GiB

    try:
        cache = HostKVCache(kv, num_blocks)
    except RuntimeError as e:  # cudaHostAlloc failed (locked-memory limit, fragmentation)
        raise InvalidRequestError(
            f"kv_offloading_size: the host could not pin {num_blocks} KV blocks: {e}", "kv_offloading_size"
        ) from None
    logger.info(
        "host KV tier: %d blocks x %d tokens = %.3f GiB of %s host memory per rank",
        num_blocks,
        kv.shape[4],
        cache.nbytes / GiB,
        "pinned" if cache.on_cuda else "plain",
    )
    return cache
