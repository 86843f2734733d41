"""Every environment variable pagedllm reads, in one module, read when asked (not at import).

| variable | read by | meaning |
| --- | --- | --- |
| `PAGEDLLM_API_KEY` | `pagedllm serve`, `pagedllm bench serve` | API key when `--api-key` is not given |
| `PAGEDLLM_KEEP_ALIVE_ON_ENGINE_DEATH` | `pagedllm serve` | `1`: keep serving 503s after the engine core died instead of exiting (vLLM's `VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`); `--keep-alive-on-engine-death` wins |
| `PAGEDLLM_HTTP_TIMEOUT_KEEP_ALIVE` | `pagedllm serve` | seconds an idle connection is kept: after a response, and for a new connection to send its request head (5, as vLLM's `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`) |
| `PAGEDLLM_LOGGING_LEVEL` | the CLI, and `LLM` when it adds its default handler (`entrypoints/logs.py`) | log level (DEBUG, INFO, ...) unless `--debug` |
| `PAGEDLLM_TP_TIMEOUT_S` | tensor parallelism | seconds a collective may take before a rank is declared stuck (300) |
| `PAGEDLLM_SAMPLER` | the model runner | `torch`: sample with the torch path instead of the fused kernel |
| `PAGEDLLM_TIMELINE` | the server's API and engine-core processes | a path prefix: write each request's stage times there (engine/timeline.py; `benchmarks/request_timeline.py` reads them) |
| `PAGEDLLM_PREFILL_GRAPHS` | the model runner | how prefill and mixed steps run on CUDA: `full` (the default: small steps replay one whole-step graph, `worker/mixed_graphs.py`, larger ones piecewise graphs), `piecewise` (`worker/piecewise_graphs.py` only), `eager` |
| `PAGEDLLM_ATTENTION_TILES` | the paged-attention kernel | JSON overriding rows of `ops/paged_attention.py: TILES`, e.g. `{"decode/fp8": [128, 4, 2]}` ((BLOCK_N, num_warps, num_stages) by phase and KV format): retuning on other hardware, and A/B runs |
| `PAGEDLLM_DECODE_LAUNCH_ORDER` | the model runner | `longest` (the default): decode attention launches the batch longest first (`ops/attention_metadata.py: longest_first`); `batch`: in batch order (A/B runs) |
| `PAGEDLLM_DECODE_GEMM` | the linear layers (CUDA) | `triton` (the default): bfloat16 / float16 products of at most 16 rows (`ops/decode_gemm.py: MAX_ROWS`) run `ops/decode_gemm.py`; `cublas`: every product runs `F.linear` (A/B runs) |
| `PAGEDLLM_LOG_TRITON_COMPILES` | the model runner (CUDA) | `1`: log every Triton kernel compiled in this process, with its time (`worker/triton_compiles.py`): a compile after start-up is a step that waited for it |
| `PAGEDLLM_COMMIT` | benchmarks | the commit recorded with a result row (else `git rev-parse`) |
| `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `LOCAL_RANK` | tensor parallelism | set by `torchrun` |
| `TRITON_INTERPRET` | `pagedllm.ops` | set to 1 when there is no GPU, so kernels run on CPU |
"""

from __future__ import annotations

import functools
import json
import os


def api_key() -> str | None:
    return os.environ.get("PAGEDLLM_API_KEY") or None


def child_environ(api_key: str | None = None) -> dict[str, str]:
    """This process's environment for a child, with PAGEDLLM_API_KEY set when a key is given."""
    env = dict(os.environ)
    if api_key:
        env["PAGEDLLM_API_KEY"] = api_key
    return env


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def keep_alive_on_engine_death() -> bool:
    return _flag("PAGEDLLM_KEEP_ALIVE_ON_ENGINE_DEATH")


def http_timeout_keep_alive() -> float:
    return float(os.environ.get("PAGEDLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5"))


def logging_level(default: str) -> str:
    return os.environ.get("PAGEDLLM_LOGGING_LEVEL", default).upper()


def tp_timeout_s() -> float:
    return float(os.environ.get("PAGEDLLM_TP_TIMEOUT_S", "300"))


def sampler() -> str:
    """ "" (the fused kernel where there is one) or "torch"."""
    return os.environ.get("PAGEDLLM_SAMPLER", "")


def prefill_graphs() -> str:
    """ "full", "piecewise" or "eager" (PAGEDLLM_PREFILL_GRAPHS; default full)."""
    mode = os.environ.get("PAGEDLLM_PREFILL_GRAPHS", "full").strip().lower() or "full"
    if mode not in ("full", "piecewise", "eager"):
        raise ValueError(f"PAGEDLLM_PREFILL_GRAPHS must be full, piecewise or eager, got {mode!r}")
    return mode


def attention_tiles() -> dict[tuple[str, str], tuple[int, int, int]]:
    """PAGEDLLM_ATTENTION_TILES parsed: {("decode", "fp8"): (BLOCK_N, num_warps, num_stages), ...};
    ("decode_split", "fp8") is the tile of an fp8 decode that runs in splits."""
    return _parse_tiles(os.environ.get("PAGEDLLM_ATTENTION_TILES", ""))


@functools.lru_cache(maxsize=4)
def _parse_tiles(text: str) -> dict[tuple[str, str], tuple[int, int, int]]:
    if not text.strip():
        return {}
    try:
        rows = json.loads(text)
        out = {}
        for key, val in rows.items():
            phase, fmt = key.split("/")
            if phase not in ("decode", "decode_split", "prefill") or fmt not in ("16bit", "fp8"):
                raise ValueError(key)
            if phase == "decode_split" and fmt != "fp8":  # only fp8 decode has a split row
                raise ValueError(key)
            block_n, warps, stages = (int(x) for x in val)
            out[(phase, fmt)] = (block_n, warps, stages)
        return out
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(
            'PAGEDLLM_ATTENTION_TILES must be JSON like {"decode/fp8": [64, 1, 1]} '
            f"(keys decode|prefill / 16bit|fp8, and decode_split/fp8), got {text!r}"
        ) from e


def decode_launch_order() -> str:
    v = os.environ.get("PAGEDLLM_DECODE_LAUNCH_ORDER", "longest").strip().lower() or "longest"
    if v not in ("longest", "batch"):
        raise ValueError(f"PAGEDLLM_DECODE_LAUNCH_ORDER must be 'longest' or 'batch', got {v!r}")
    return v


def decode_gemm() -> str:
    v = os.environ.get("PAGEDLLM_DECODE_GEMM", "triton").strip().lower() or "triton"
    if v not in ("triton", "cublas"):
        raise ValueError(f"PAGEDLLM_DECODE_GEMM must be 'triton' or 'cublas', got {v!r}")
    return v


def timeline_prefix() -> str | None:
    return os.environ.get("PAGEDLLM_TIMELINE") or None


def log_triton_compiles() -> bool:
    return _flag("PAGEDLLM_LOG_TRITON_COMPILES")


def commit() -> str | None:
    return os.environ.get("PAGEDLLM_COMMIT") or None


def torchrun() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by torchrun, else None."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def torchrun_keys() -> tuple[str, ...]:
    """The variables a child process must not inherit to be a launch of its own."""
    return ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def default_triton_interpret() -> None:
    """Kernels run through Triton's interpreter on CPU; it must be chosen before triton is imported."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
