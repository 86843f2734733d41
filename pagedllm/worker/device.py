"""Where and in what precision a ModelRunner runs: the device and dtype names a user gives, and
the host memory the CPU path sizes its KV cache from."""

from __future__ import annotations

import torch

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


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB
