"""Kernels and their torch references.

KV cache layout (one tensor per layer and K/V):
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
so one (block, kv_head) tile of block_size x head_dim is contiguous: the attention
kernels read it once for all query heads of its GQA group.
slot = block_id * block_size + offset; PAD_SLOT_ID (-1) means "do not store" (padding).
The kernels and references skip every negative slot; writers use PAD_SLOT_ID.
"""

import importlib.util as _importlib_util

# Whether triton is installed. Checked without importing it, so the CPU path (torch
# references only) never pays for, or depends on, triton. The kernels live in
# store_kv.py, paged_attention.py and fused.py; import them only where HAS_TRITON.
HAS_TRITON = _importlib_util.find_spec("triton") is not None

PAD_SLOT_ID = -1  # a slot_mapping entry whose K/V is not stored (padding rows, profiling runs)
