from pagedllm.entrypoints.cli import add_engine_args, engine_kwargs  # replaced by the cli helper

__all__ = ["add_engine_args", "engine_kwargs"]
