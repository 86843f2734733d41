"""Import guard shared by the kernel modules.

Triton is optional: the CPU path never needs it. On a machine without CUDA, Triton can only
run kernels through its interpreter, and `triton.jit` chooses interpreter or compiler when a
kernel is decorated, so the environment variable must be set before any kernel module is
imported; setting it here covers that, provided nothing imported triton itself before
(triton decorates its own helpers such as tl.zeros at import time, so a process that
imported triton without TRITON_INTERPRET cannot interpret kernels afterwards).
"""

from __future__ import annotations

import torch

from pagedllm import envs

if not torch.cuda.is_available():
    envs.default_triton_interpret()

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None
    HAS_TRITON = False


def is_interpreted(kernel) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET (runs in numpy on the host).

    Triton's interpreter multiplies bf16 `tl.dot` operands as raw uint16 (seen with triton
    3.9), so kernels upcast dot operands to fp32 when interpreted.
    """
    return HAS_TRITON and not isinstance(kernel, triton.runtime.JITFunction)


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("pagedllm.ops kernels need triton; use the *_ref functions on CPU")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


_NUM_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessor count (host-side, cached, no sync); 1 off CUDA."""
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]
