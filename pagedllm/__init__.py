"""pagedllm: vLLM's design (PagedAttention, prefix caching, continuous batching) in readable Python."""

from __future__ import annotations

__version__ = "0.1.0"

from pagedllm.engine.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput  # noqa: E402  (torch-free)
from pagedllm.engine.sampling_params import BeamSearchParams, SamplingParams  # noqa: E402
from pagedllm.entrypoints.model_dir import default_model_path  # noqa: E402  (the one reader of model directories)


def __getattr__(name: str):
    # LLM pulls in torch; import it only when asked, so `import pagedllm.engine` stays torch-free.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")


__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "default_model_path",
    "__version__",
]
