"""What every benchmark row records: commit, GPU, library versions, date."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys

from pagedllm import envs


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
            timeout=10,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_copy_TBps() -> float:
    """The device's copy rate (TB/s of bytes read plus written) over a 1 GiB device-to-device copy
    launched eagerly: the yardstick of the memory-bound kernels' benchmarks. Captured in a CUDA graph
    the same copy becomes a copy-engine node and reads ~2.8 TB/s on an H200, not the kernels' ~4.3."""
    import torch

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        y.copy_(x)
    b.record()
    b.synchronize()
    return 2 * x.numel() * 20 / (a.elapsed_time(b) / 1000) / 1e12


# the environment variables that change which kernels a run uses (pagedllm/envs.py): a result row names those set
KERNEL_SWITCHES = (
    "PAGEDLLM_DECODE_GEMM",
    "PAGEDLLM_ATTENTION_TILES",
    "PAGEDLLM_DECODE_LAUNCH_ORDER",
    "PAGEDLLM_PREFILL_GRAPHS",
    "PAGEDLLM_SAMPLER",
)


def environment() -> dict:
    import torch

    env: dict[str, object] = {
        "commit": envs.commit() or git_commit(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpu_count": os.cpu_count(),
    }
    settings = {k: os.environ[k] for k in KERNEL_SWITCHES if os.environ.get(k)}
    if settings:  # the switches this run had set (pagedllm/envs.py); none set: the defaults
        env["settings"] = settings
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def gpu_slug(gpu: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "cpu"


def save_results(result: dict | list[dict], args, name: str) -> None:
    """What each benchmark script does with its row(s): appended to `args.results_dir`/<name>.json
    unless `args.no_save` (the path on stderr), and written as given to `args.out` if set."""
    rows = result if isinstance(result, list) else [result]
    if not args.no_save:
        for r in rows:
            path = append_result(r, args.results_dir, name)
        print(f"results appended to {path}", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def append_result(row: dict, results_dir: str, name: str | None = None) -> str:
    os.makedirs(results_dir, exist_ok=True)
    path = os.path.join(results_dir, f"{name or gpu_slug(row.get('gpu', 'cpu'))}.json")
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = json.load(f)
    rows.append(row)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    return path


def append_json_line(row: dict, path: str | None) -> None:
    """One benchmark row appended to a JSON-lines file (the scripts' --out); None: not saved."""
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
