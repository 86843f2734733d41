"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time, in one process.

Three parts in a line (docs/architecture.md): the InputProcessor checks a request once
(input_processor.py), the EngineCore schedules and runs it and returns token ids (core.py), the
OutputProcessor turns those into text, stop strings and RequestOutputs (output_processor.py).
The server runs the same EngineCore in a process of its own and the same OutputProcessor in
its API process (entrypoints/async_llm.py).
"""

from __future__ import annotations

import itertools
from typing import IO, Any

from pagedllm.engine.config import SchedulerConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.executor import Executor
from pagedllm.engine.grammar import grammar_tokenizer
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.messages import EngineCoreRequest, Metrics
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.sampling_params import SamplingParams


class LLMEngine:
    def __init__(
        self,
        config: SchedulerConfig,
        executor: Executor,
        tokenizer: Any = None,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        vocab_size: int | None = None,
        trace_sink: IO[str] | list[dict[str, object]] | None = None,
        async_scheduling: bool = False,
    ):
        # one llguidance tokenizer, built on first use, for the edge check and the core's compilations
        llg = None if tokenizer is None else grammar_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.core = EngineCore(config, executor, eos_token_ids, trace_sink, async_scheduling, llg)
        self.config = config
        self.executor = executor
        self.kv = self.core.kv
        self.scheduler = self.core.scheduler
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.input_processor = InputProcessor(
            tokenizer,
            vocab_size,
            config.max_model_len,
            config.block_size,
            config.num_kv_blocks,
            max_num_seqs=config.max_num_seqs,
            kv_cache_groups=self.kv.groups,
            max_num_batched_tokens=config.max_num_batched_tokens,
            grammar_tokenizer=llg,
        )
        self.output_processor = OutputProcessor(tokenizer)  # tokenizer None: token ids only (text "")
        self._ids = itertools.count()

    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    # ---- requests ----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: Any,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        stream: bool = True,
    ) -> str:
        """Queue a request. With stream=True, step() returns an output for it whenever it gets a
        token (cumulative text plus delta); with stream=False only once, when it finishes. A
        request with best_of > n is never streamed: its one output comes when it finishes.

        `prompt` is a str, token ids or a prompt dict (checked here by the InputProcessor,
        InvalidRequestError on failure), or an EngineCoreRequest that the InputProcessor already
        made (queued as it is; `params` and `arrival_time` are then its own)."""
        if isinstance(prompt, EngineCoreRequest):
            assert request_id is None or str(request_id) == prompt.request_id
            assert params is None or params is prompt.params
            request = prompt
        else:
            request_id = str(next(self._ids)) if request_id is None else str(request_id)
            self.core.check_new_request_id(request_id)  # before tokenizing
            request = self.input_processor.process(request_id, prompt, params or SamplingParams(), arrival_time)
        self.core.add_request(request)
        self.output_processor.add_request(request, stream)
        return request.request_id

    def abort_request(self, request_id: str) -> bool:
        """Finish a request at once, wherever it is; its blocks are free when this returns."""
        self.output_processor.abort_request(request_id)
        return self.core.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One core step, then its outputs: one RequestOutput per streamed request that got
        tokens and per request that finished (cumulative text plus this step's delta).

        With async scheduling (executor.supports_async) outputs lag one step behind the launches."""
        core_outputs = self.core.step()
        if not core_outputs:
            return []
        processed = self.output_processor.process(core_outputs)
        for request_id, index in processed.stopped:
            self.core.stop_sequence(request_id, index)
        make = self.output_processor.make_output
        done = set(processed.finished)
        return [make(state) for state in processed.touched if state.stream or state in done]

    # ---- metrics -----------------------------------------------------------------------
    def get_metrics(self) -> Metrics:
        return self.core.get_metrics()
