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
