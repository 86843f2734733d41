"""Where and in what precision a ModelRunner runs: the device and dtype names a user gives, and
the host memory the CPU path sizes its KV cache from."""

from __future__ import annotations

import torch

from pagedllm.ops.kv_quant import FP8_DTYPES

GiB = 1 << 30


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is available")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return torch.device(device)


def resolve_dtype(dtype, hf_config, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "float": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "half": torch.float16,
    }
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        cfg_dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
        if isinstance(cfg_dtype, torch.dtype):
            return cfg_dtype
        return names.get(str(cfg_dtype).replace("torch.", ""), torch.bfloat16)
    if dtype not in names:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return names[dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV tensor's dtype: the model's for "auto", else fp8 (ops/kv_quant.py). ValueError naming the
    option for an unknown name, or for fp8 on a GPU whose Triton cannot convert fp8 (before sm_89)."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(FP8_DTYPES)}, got {kv_cache_dtype!r}")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU of compute capability 8.9 or newer "
                f"(Ada, Hopper) for the fp8 conversions of the Triton kernels; this one is {major}.{minor}: "
                "use kv_cache_dtype='auto'"
            )
    elif device.type != "cpu":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} runs on cuda or cpu, not on {device.type}")
    return FP8_DTYPES[kv_cache_dtype]


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """The resolved name reported in logs and metrics: "bfloat16", "fp8_e4m3", ..."""
    names = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
    return names.get(dtype, str(dtype).replace("torch.", ""))


def zeroed_host_bytes(n: int) -> torch.Tensor:
    """n zero bytes of host memory as a uint8 tensor, in O(1): an anonymous mapping, whose pages
    the OS supplies (zero-filled) when first touched. The CPU KV pool is sized up to a tenth of
    RAM, and torch.zeros would write all of it at start-up (seconds for the bundled model's
    default pool); this way a pool costs memory only as its blocks are written. The tensor keeps
    the mapping alive."""
    import mmap

    return torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8)


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB


def check_kernel_shapes(head_dim: int, rotary_dim: int) -> None:
    """The Triton kernels tile a head in one power-of-two block: refuse other sizes at start-up
    (on CPU the torch references run any size)."""
    for name, n in (("head_dim", head_dim), ("rotary dim (head_dim x partial_rotary_factor)", rotary_dim)):
        if n & (n - 1):
            raise ValueError(
                f"{name} {n} is not a power of two, which the GPU kernels need; this model runs on CPU only "
                "(device='cpu')"
            )
