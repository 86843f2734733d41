"""Shared by the TP tests: a workload with shared prefixes, HF references, a config that
forces preemption."""

from tests.model.hf_reference import GREEDY, generate, workload  # noqa: F401  (shared with tests/model)
from tests.model.hf_reference import reference as hf_reference  # noqa: F401

# a 9-block pool of 8-token blocks cannot hold the batch: the scheduler must preempt
PREEMPTING = dict(block_size=8, num_kv_blocks=9, max_num_batched_tokens=32, enable_prefix_caching=True)
