"""The CPU KV pool is an anonymous mapping: zero-filled, writable, alive as long as the tensor,
and allocated in O(1) whatever its size (the OS supplies each page when it is first touched: it
is not resident until then)."""

import gc
import os

import torch

from pagedllm.worker.device import zeroed_host_bytes


def test_zeroed_host_bytes_are_zero_writable_and_owned_by_the_tensor():
    x = zeroed_host_bytes(3 << 20)
    gc.collect()  # nothing but the tensor refers to the mapping now
    kv = x.view(torch.float32).view(3, 256, 1024)
    assert kv.is_contiguous() and not kv.any()
    kv[1, 7] = 2.5
    assert kv[1, 7].eq(2.5).all() and kv.sum() == 2.5 * 1024
    assert not x.view(torch.float8_e4m3fn).float()[: 1 << 20].any()  # the first MiB: still zeros


def _resident_bytes() -> int:
    """This process's resident memory (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_large_pool_costs_no_memory_until_it_is_written():
    """Zeroing it (or any O(n) start) would make its 8 GiB resident; only the pages read are."""
    before = _resident_bytes()
    x = zeroed_host_bytes(8 << 30)  # 8 GiB
    assert x.numel() == 8 << 30 and x[-1] == 0 and x[1 << 32] == 0
    assert _resident_bytes() - before < 256 << 20
