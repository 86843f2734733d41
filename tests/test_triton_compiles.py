"""PAGEDLLM_LOG_TRITON_COMPILES: the hooks time and log each compile (Triton calls them with
keyword arguments; here they are called as Triton would, since the CPU interpreter compiles
nothing), and install() puts them in Triton's runtime knobs."""

import logging

from pagedllm.worker.triton_compiles import CompileLog, install


def kernel():
    pass


def test_hooks_time_and_log_each_compile(caplog):
    log = CompileLog()
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert log.before(key="k1", repr="kernel[sig]", fn=kernel, compile={}, is_manual_warmup=False) is False
        assert log.after(key="k1", repr="kernel[sig]", fn=kernel, compile={}, is_manual_warmup=False) is False
    assert log.compiles == 1 and log.seconds >= 0 and not log.started
    assert "triton compiled kernel in" in caplog.text


def test_install_sets_the_runtime_hooks():
    from triton import knobs

    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    try:
        log = install()
        assert log is not None
        assert knobs.runtime.jit_cache_hook == log.before and knobs.runtime.jit_post_compile_hook == log.after
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before
