"""Every executor conforms to engine/executor.py's Executor protocol explicitly: ModelRunner,
TPExecutor and the engine tests' fake. `conforming` is checked by mypy (run it on this file:
a missing or mistyped member is an error); the tests check the same members at run time."""

from __future__ import annotations

import inspect

import pytest
import torch

from pagedllm.engine.config import RESOLVED_KV_CACHE_DTYPES
from pagedllm.engine.executor import Executor
from pagedllm.engine.kv_cache_groups import KVCacheGroup
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.tp_executor import TPExecutor
from tests.engine.fake_runner import ShadowRunner

MEMBERS = ("num_kv_blocks", "kv_cache_dtype", "kv_cache_groups", "supports_async", "execute", "execute_async", "close")


def conforming(runner: ModelRunner, tp: TPExecutor, fake: ShadowRunner) -> list[Executor]:
    return [runner, tp, fake]


def test_the_protocol_is_what_this_test_checks():
    declared = {n for n, _ in inspect.getmembers(Executor) if not n.startswith("_")}
    assert declared == set(MEMBERS)


def check(executor, supports_async: bool) -> None:
    assert isinstance(executor.num_kv_blocks, int) and executor.num_kv_blocks > 0
    assert executor.supports_async is supports_async
    assert executor.kv_cache_dtype in RESOLVED_KV_CACHE_DTYPES
    groups = executor.kv_cache_groups
    assert groups and all(isinstance(g, KVCacheGroup) for g in groups)
    for name in ("execute", "execute_async", "close"):
        assert callable(getattr(executor, name)), name


def test_model_runner(tiny_models):
    from transformers import AutoConfig

    path = tiny_models["qwen3"]
    runner = ModelRunner(
        AutoConfig.from_pretrained(path),
        path,
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
        num_kv_blocks=16,
    )
    check(runner, supports_async=True)  # on CPU too: the ids are on the host at once
    assert runner.num_kv_blocks == 16
    runner.close()


def test_tp_executor_declares_every_member_itself():
    """No forwarding to rank 0's runner: each member is TPExecutor's own (a real group is
    checked in test_tp_equivalence.py)."""
    assert TPExecutor.supports_async is False
    assert isinstance(inspect.getattr_static(TPExecutor, "num_kv_blocks"), property)
    assert not hasattr(TPExecutor, "__getattr__")
    for name in ("execute", "execute_async", "close"):
        assert name in vars(TPExecutor), name
    with pytest.raises(NotImplementedError):
        TPExecutor.execute_async(object.__new__(TPExecutor), None)  # type: ignore[arg-type]


@pytest.mark.parametrize("supports_async", [True, False])
def test_fake(supports_async):
    fake = ShadowRunner(4, num_kv_blocks=12, supports_async=supports_async)
    check(fake, supports_async)
    assert fake.num_kv_blocks == 12
    fake.close()
    assert fake.closed
