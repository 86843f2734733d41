"""The `LLM` class: vLLM's offline API on top of LLMEngine and a ModelRunner."""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from pagedllm.engine import LLMEngine, RequestOutput, SamplingParams, SchedulerConfig
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.executor import Executor
from pagedllm.engine.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput
from pagedllm.engine.sampling_params import BeamSearchParams, sampling_params_with_defaults
from pagedllm.engine.spec_config import SpeculativeConfig
from pagedllm.engine.startup_times import StartupTimes
from pagedllm.entrypoints.llm_checks import check_llm_arguments
from pagedllm.entrypoints.logs import ensure_log_handler
from pagedllm.entrypoints.model_dir import (
    eos_token_ids,
    generation_defaults,
    load_hf_config,
    load_tokenizer,
    resolve_model_path,
)

logger = logging.getLogger("pagedllm")


class LLM:
    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        prefix_caching_hash_algo: str = "xxhash",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        trace_blocks: bool = False,
        async_scheduling: bool | None = None,
        generation_config: str = "auto",
        kv_cache_dtype: str = "auto",
        revision: str | None = None,
        download_dir: str | None = None,
        tokenizer_mode: str = "auto",
        trust_remote_code: bool = False,
        enable_chunked_prefill: bool = True,
        load_format: str = "auto",
        quantization: str | None = None,
        kv_offloading_size: float = 0.0,
        preemption_mode: str = "recompute",
        speculative_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        """vLLM's arguments. `model`: a local Hugging Face directory or a hub id already in the
        local Hugging Face cache (`revision`: its branch, tag or commit; `download_dir`: the cache
        to look in); nothing is downloaded. `trust_remote_code` changes nothing: pagedllm never
        runs a model's own code, it runs the architectures it implements (model/registry.py), and
        any other fails naming it. `enable_chunked_prefill` is always on (a prompt longer than
        max_num_batched_tokens is prefilled over several steps); False is refused.
        `speculative_config`: vLLM's dict, {"method": "ngram", "num_speculative_tokens": k,
        "prompt_lookup_max": a, "prompt_lookup_min": b} or {"model": DRAFT_DIR, "num_speculative_tokens": k}
        (docs/features/speculative-decoding.md)."""
        check_llm_arguments(  # llm_checks.py: refusals that need no model, before anything loads
            kwargs,
            enable_chunked_prefill=enable_chunked_prefill,
            tokenizer_mode=tokenizer_mode,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            async_scheduling=async_scheduling,
            load_format=load_format,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            kv_offloading_size=kv_offloading_size,
            enable_prefix_caching=enable_prefix_caching,
            preemption_mode=preemption_mode,
        )
        spec = SpeculativeConfig.parse(speculative_config)  # refuses what it cannot run exactly, naming the key
        ensure_log_handler()  # the INFO lines (KV cache size, ...) visible as in vLLM, unless logging is set up
        started = time.perf_counter()
        startup = StartupTimes()
        model = resolve_model_path(os.fspath(model), revision, download_dir)
        if tokenizer is not None:
            tokenizer = resolve_model_path(os.fspath(tokenizer), param="tokenizer")
        with startup.phase("config"):
            hf_config = load_hf_config(model)
        self.generation_defaults = generation_defaults(model, generation_config)
        from pagedllm.model.registry import layer_windows

        try:  # fail early, naming the field: an unknown architecture, a variant the decoder cannot run exactly
            layer_windows(hf_config)
        except ValueError as e:
            raise InvalidRequestError(str(e), "model") from None
        with startup.phase("tokenizer"):
            self.tokenizer = load_tokenizer(tokenizer or model)
        limit = getattr(hf_config, "max_position_embeddings", 4096)
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len > limit:
            raise InvalidRequestError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}", "max_model_len"
            )
        SchedulerConfig(
            num_kv_blocks=1,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            prefix_caching_hash_algo=prefix_caching_hash_algo,
        )  # validate (kv_cache_dtype: checked above, against the names a user may give)
        import torch  # noqa: F401  (heavy imports only once the arguments are known good)

        from pagedllm.worker.host_kv_cache import host_kv_blocks
        from pagedllm.worker.model_runner import ModelRunner, resolve_device, resolve_dtype

        dev = resolve_device(device)
        host_kv_blocks(kv_offloading_size, 1, 1)  # refuses a size the host cannot hold before the model loads
        eos = eos_token_ids(model, hf_config, self.tokenizer)  # the runner masks them under min_tokens
        runner_kwargs: dict[str, Any] = dict(
            device=dev,
            dtype=resolve_dtype(dtype, hf_config, dev),
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            seed=seed,
            eos_token_ids=eos,
            kv_cache_dtype=kv_cache_dtype,
            load_format=load_format,
            quantization=quantization,
            kv_offloading_size=kv_offloading_size,
        )
        if spec is not None and spec.uses_draft_model:  # checked against the target before any weight loads
            from pagedllm.entrypoints.draft_check import check_draft_model

            runner_kwargs["draft"] = check_draft_model(
                spec, hf_config, self.tokenizer, max_model_len, tensor_parallel_size
            )
        self.runner: Executor  # a ModelRunner, or a TPExecutor over tensor_parallel_size processes
        from pagedllm.worker.tp_executor import TPExecutor

        runner: ModelRunner | TPExecutor
        with startup.phase("model runner"):
            if tensor_parallel_size > 1:
                runner = TPExecutor(hf_config, model, tensor_parallel_size, **runner_kwargs)
            else:
                runner = ModelRunner(hf_config, model, **runner_kwargs)
        self.runner = runner
        config = SchedulerConfig(
            num_kv_blocks=self.runner.num_kv_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            prefix_caching_hash_algo=prefix_caching_hash_algo,
            trace_blocks=trace_blocks,
            kv_cache_dtype=self.runner.kv_cache_dtype,
            num_host_kv_blocks=runner.num_host_kv_blocks,
            preemption_mode=preemption_mode,
            kv_block_bytes=runner.block_bytes * tensor_parallel_size,
            speculative_config=spec,
        )
        self.hf_config = hf_config
        self.model_path = model
        if async_scheduling is None:  # auto: on where the host can run ahead of a device
            async_scheduling = dev.type == "cuda" and tensor_parallel_size == 1
        with startup.phase("engine"):
            self.engine = LLMEngine(
                config,
                self.runner,
                self.tokenizer,
                eos,
                vocab_size=hf_config.vocab_size,
                async_scheduling=async_scheduling,
            )
        self._counter = 0
        # where start-up went: ours, then the model runner's own phases (rank 0's under TP: none)
        runner_phases = self.runner.startup.seconds if isinstance(self.runner, ModelRunner) else {}
        self.startup_seconds = {**startup.seconds, **runner_phases, "total": time.perf_counter() - started}
        host_tier = ""
        if config.num_host_kv_blocks:
            gib = config.num_host_kv_blocks * config.kv_block_bytes / (1 << 30)
            host_tier = (
                f"; host KV tier {gib:.3f} GiB ({config.num_host_kv_blocks} blocks, {preemption_mode} preemption)"
            )
        logger.info(
            "ready in %.2f s%s: %s%s",
            self.startup_seconds["total"],
            host_tier,
            startup.summary(),
            f"; model runner: {self.runner.startup.summary()}" if isinstance(self.runner, ModelRunner) else "",
        )

    # ---- generation --------------------------------------------------------------------
    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order, one RequestOutput per prompt (the
        progress bar counts prompts). Without sampling_params each request gets
        `get_default_sampling_params()` (the model's generation defaults).

        As vLLM's: a RequestOutput holds `n` CompletionOutputs (index 0..n-1; with best_of > n
        the n of the best_of samples with the highest cumulative logprob, best first); with
        `logprobs=k` each has one {token id: Logprob} per output token and `cumulative_logprob`;
        with `prompt_logprobs=k` the RequestOutput has one entry per prompt token (the first None).
        n (or best_of) above max_num_seqs runs in waves of max_num_seqs samples (up to MAX_SAMPLES)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(
                    f"sampling_params has {len(params)} entries for {len(prompts)} prompts", "sampling_params"
                )
        # every request is checked (InputProcessor.process) before any is queued: a bad prompt
        # leaves the engine untouched, and the requests carry their token ids from here on
        first = self._counter
        requests = [
            self.engine.input_processor.process(f"gen-{first + i}", prompt, p)
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
        ]
        self._counter += len(requests)
        for r in requests:  # queued as checked, not validated again
            self.engine.add_request(r.request_id, r, stream=False)
        return self._run([r.request_id for r in requests], use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of OpenAI messages) or a list of them, each
        rendered by the chat template (the tokenizer's, or `chat_template`) with `tools` offered
        to it, then generated as `generate` does; one RequestOutput per conversation. Control
        tokens come from the template only (entrypoints/chat_utils.py)."""
        from pagedllm.entrypoints.chat_utils import ChatOptions, SpecialTexts, check_tools, conversation_of, render_chat

        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            conversations: list[Any] = [messages]
        else:
            conversations = list(messages)
        options = ChatOptions(
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=check_tools(tools) if tools is not None else None,
            template_kwargs=dict(chat_template_kwargs or {}),
        )
        specials = SpecialTexts.of(self.tokenizer) if self.tokenizer is not None else None  # once for all
        prompts = []
        for conv in conversations:
            text, ids = render_chat(self.tokenizer, conversation_of(conv), options, specials)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: Any, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search (vLLM's `LLM.beam_search`; HF transformers' algorithm, engine/beam_search.py):
        per prompt its `params.beam_width` best sequences, best (highest score) first. The beams
        of a prompt share the prompt's KV blocks and every common prefix (fork + copy-on-write)
        and all beams of all prompts run in one batched decode per step."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError(f"params must be a BeamSearchParams, got {type(params).__name__}", "params")
        outputs = self.generate(prompts, params.sampling, use_tqdm=use_tqdm)
        return [BeamSearchOutput([self._beam(out, c) for c in out.outputs]) for out in outputs]

    def _beam(self, out: RequestOutput, c: CompletionOutput) -> BeamSearchSequence:
        assert c.cumulative_logprob is not None and c.score is not None, "the core sends both for every beam"
        tokens = out.prompt_token_ids + c.token_ids
        tok = self.engine.tokenizer
        return BeamSearchSequence(
            tokens=tokens,
            text="" if tok is None else tok.decode(tokens, skip_special_tokens=True),
            output_token_ids=c.token_ids,
            output_text=c.text,
            cum_logprob=c.cumulative_logprob,
            score=c.score,
            finish_reason=c.finish_reason,
        )

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(done) < len(wanted):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in request_ids:  # leave nothing half-run behind
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in request_ids]

    def get_metrics(self) -> dict:
        return self.engine.get_metrics()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix held by free blocks (as vLLM's LLM.reset_prefix_cache)."""
        self.engine.kv.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams of a request that sets nothing: the model's generation defaults (its
        generation_config.json, unless LLM(generation_config="vllm")), then SamplingParams' own."""
        return sampling_params_with_defaults(self.generation_defaults)

    def get_tokenizer(self):
        return self.tokenizer

    def close(self) -> None:
        self.runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


LLM_ARGUMENTS = [p for p in inspect.signature(LLM.__init__).parameters if p not in ("self", "model", "kwargs")]
