"""worker/graph_capture.py: no garbage collection while CUDA graphs are captured."""

import gc

from pagedllm.worker.graph_capture import no_collection_while_capturing


class Canary:
    collected = 0

    def __del__(self):
        Canary.collected += 1


def test_garbage_is_collected_first_and_no_collection_runs_inside():
    Canary.collected = 0
    c = Canary()
    c.self = c  # a cycle: only a collection frees it
    del c
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        with no_collection_while_capturing():
            assert Canary.collected == 1 and not gc.isenabled()
            d = Canary()
            d.self = d
            del d
            _ = [[] for _ in range(1000)]  # allocations that would start a collection
            assert Canary.collected == 1
        assert gc.isenabled()
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()
    assert Canary.collected == 2


def test_collection_left_off_when_the_caller_had_turned_it_off():
    gc.disable()
    try:
        with no_collection_while_capturing():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_running_out_of_memory_while_capturing_names_what_to_change():
    import pytest
    import torch

    from pagedllm.worker.graph_capture import explain_capture_oom

    with pytest.raises(ValueError) as info:
        with explain_capture_oom(0.9, 58 * 2**30, "sized by the profile run"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 300.00 MiB")
    message = str(info.value)
    assert "58.00 GiB" in message and "gpu_memory_utilization (now 0.9)" in message
    assert "enforce_eager=True" in message and "sized by the profile run" in message
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    # a failed capture raises its own error on top of the out-of-memory one: still explained
    with pytest.raises(ValueError):
        with explain_capture_oom(0.9, 1, "sized by num_kv_blocks"):
            try:
                raise torch.OutOfMemoryError("CUDA out of memory")
            except torch.OutOfMemoryError:
                raise RuntimeError("operation failed due to a previous error during capture")  # noqa: B904
    # other errors pass through unchanged
    with pytest.raises(RuntimeError, match="unrelated"):
        with explain_capture_oom(0.9, 1, "sized by num_kv_blocks"):
            raise RuntimeError("unrelated")
