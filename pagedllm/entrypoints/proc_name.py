"""Process names that `ps -o comm`, `top` and /proc/PID/comm show: `pagedllm-core` for the engine
core, `pagedllm-api-N` for the N-th API process of `pagedllm serve --api-server-count`, so that an
operator (and a test) can tell the processes of one server apart."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

PR_SET_NAME = 15  # linux/prctl.h


def set_process_name(name: str) -> None:
    """Set this process's name (Linux: at most 15 bytes are kept); a no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass
