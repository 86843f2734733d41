"""FP8 and 4-bit experts on the GPU (run with `pytest -m gpu`): the fused kernels (ops/fused_moe_fp8.py,
ops/fused_moe_int4.py) at Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes against their torch reference
(ops/moe_quant.py: quant_moe_ref, the same bytes dequantized), in a CUDA graph, and the engine on tiny
quantized Qwen3-MoE and Mixtral checkpoints with CUDA graphs on and off against the CPU path."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.ops.fp8_linear import FP8
from pagedllm.ops.fused_moe_fp8 import fused_moe_fp8
from pagedllm.ops.fused_moe_int4 import fused_moe_int4
from pagedllm.ops.moe_quant import Fp8Stack, Int4Stack, quant_moe_ref
from tests.model.hf_reference import workload
from tests.model.test_fp8_checkpoints import write
from tests.model.test_moe import moe_checkpoints
from tests.model.test_moe_quant_checkpoints import FP8 as FP8_FLAGS
from tests.model.test_moe_quant_checkpoints import INT4 as INT4_FLAGS
from tests.ops.test_fused_moe import SHAPES, routing

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def fp8_stack(e: int, n: int, k: int, block: tuple[int, int] | None, seed: int) -> Fp8Stack:
    g = torch.Generator(device=DEV).manual_seed(seed)
    weight = torch.empty(e, n, k, device=DEV).normal_(0, 64, generator=g).clamp_(-448, 448).to(FP8)
    shape = (e, n) if block is None else (e, n // block[0], k // block[1])
    scale = torch.rand(shape, device=DEV, generator=g) / (64 * k**0.5) + 1e-5
    return Fp8Stack(weight, scale, block)


def int4_stack(e: int, n: int, k: int, group: int, desc_act: bool, seed: int) -> Int4Stack:
    g = torch.Generator(device=DEV).manual_seed(seed)
    words = torch.randint(-(2**31), 2**31 - 1, (e, k // 8, n), device=DEV, dtype=torch.int32, generator=g)
    scales = ((torch.rand(e, k // group, n, device=DEV, generator=g) + 0.5) / (8 * k**0.5)).half()
    zeros = torch.randint(0, 17, (e, k // group, n), device=DEV, generator=g).to(torch.uint8)
    perm = None
    if desc_act:
        perm = torch.stack([torch.randperm(k, device=DEV, generator=g) for _ in range(e)]).to(torch.int32)
    return Int4Stack(words, scales, zeros, perm, group)


def stacks(variant: str, shape: str):
    e, h, i, _ = SHAPES[shape]
    if variant == "fp8-block":
        return fp8_stack(e, 2 * i, h, (128, 128), 1), fp8_stack(e, h, i, (128, 128), 2)
    if variant == "fp8-row":
        return fp8_stack(e, 2 * i, h, None, 1), fp8_stack(e, h, i, None, 2)
    desc_act = variant == "int4-desc-act"
    return int4_stack(e, 2 * i, h, 128, desc_act, 1), int4_stack(e, h, i, 128, desc_act, 2)


def run(variant: str, x, w13, w2, w, ids):
    kernel = fused_moe_fp8 if variant.startswith("fp8") else fused_moe_int4
    return kernel(x, w13, w2, w, ids)


VARIANTS = ["fp8-block", "fp8-row", "int4", "int4-desc-act"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("t", [1, 7, 64, 256, 2048])
def test_kernels_match_the_reference_at_real_shapes(variant, shape, t):
    e, h, _, k = SHAPES[shape]
    w13, w2 = stacks(variant, shape)
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16, generator=torch.Generator(device=DEV).manual_seed(t))
    for kind in ("random", "hot"):
        w, ids = routing(kind, t, e, k, DEV)
        want = quant_moe_ref(x, w13, w2, w, ids).float()
        got = run(variant, x, w13, w2, w, ids).float()
        err = (got - want).abs().max() / want.abs().max()
        # per-token activation scales over a whole row (fp8-row) flip more e4m3 roundings between the
        # kernel and the reference than block scales do; the largest of them grows with the tokens:
        # measured on one H200 at 2a5a8ce, 0.030 (qwen3-30b-a3b, 2,048 tokens, one hot expert)
        tol = 4e-2 if variant == "fp8-row" and t >= 2048 else 2e-2
        assert err < tol, (variant, shape, t, kind, float(err))


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_kernels_match_the_reference_closely(variant):
    """float32 activations: fp8 dots exact in their products; the 4-bit kernel's dot in IEEE float32."""
    e, h, i, k = 16, 512, 256, 4
    if variant.startswith("fp8"):
        block = (128, 128) if variant == "fp8-block" else None
        w13, w2 = fp8_stack(e, 2 * i, h, block, 3), fp8_stack(e, h, i, block, 4)
    else:
        desc = variant == "int4-desc-act"
        w13, w2 = int4_stack(e, 2 * i, h, 64, desc, 3), int4_stack(e, h, i, 64, desc, 4)
    x = torch.randn(40, h, device=DEV, generator=torch.Generator(device=DEV).manual_seed(5))
    w, ids = routing("random", 40, e, k, DEV)
    want = quant_moe_ref(x, w13, w2, w, ids)
    got = run(variant, x, w13, w2, w, ids)
    # fp8: the kernel's float32 intermediate may differ from the reference's in its last bits, and a
    # flipped e4m3 rounding of one of its elements moves the output by one quantization step
    tol = 1e-2 if variant.startswith("fp8") else 1e-4
    torch.testing.assert_close(got, want, rtol=0, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("variant", VARIANTS)
def test_captured_in_a_cuda_graph(variant):
    """No host synchronisation: the call captures, and replays with new routings give new results."""
    e, h, _, k = SHAPES["qwen3-30b-a3b"]
    w13, w2 = stacks(variant, "qwen3-30b-a3b")
    x = torch.randn(16, h, device=DEV, dtype=torch.bfloat16)
    w, ids = routing("random", 16, e, k, DEV)
    run(variant, x, w13, w2, w, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(variant, x, w13, w2, w, ids)
    for seed in (5, 6):
        w_new, ids_new = routing("random", 16, e, k, DEV, seed=seed)
        w.copy_(w_new)
        ids.copy_(ids_new)
        graph.replay()
        want = quant_moe_ref(x, w13, w2, w, ids).float()
        assert (out.float() - want).abs().max() / want.abs().max() < 2e-2


# ------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def moe_models(tiny_models, tmp_path_factory):
    return moe_checkpoints(tiny_models["qwen3"], tmp_path_factory)


def greedy(llm: LLM, prompts, max_tokens) -> list[list[int]]:
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=m) for m in max_tokens]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


ENGINE_FORMATS = {**FP8_FLAGS, **INT4_FLAGS}


@pytest.mark.parametrize("fmt", list(ENGINE_FORMATS))
@pytest.mark.parametrize("kind", ["qwen3moe_top2", "mixtral"])
def test_fp32_engine_with_and_without_graphs_equals_the_cpu_path(moe_models, tmp_path, kind, fmt):
    """The kernels inside the engine (prefill chunks eager, decode steps in CUDA graphs, or all eager)
    against the CPU path (the reference): the same greedy tokens for 4-bit weights (weight-only: exact);
    W8A8 at least 60% of them, position by position: a kernel's float32 sums differ from the reference's
    in their last bits, which moves some activations across an e4m3 rounding step, and on these
    random-weight models (flat logits) one changed token changes the rest of its output. Measured on
    one H200 at 2a5a8ce: 0.70 to 0.92 (a broken kernel gives ~0 from the first token)."""
    ckpt = write(moe_models[kind], str(tmp_path / fmt), *ENGINE_FORMATS[fmt])
    prompts, max_tokens = workload(3, n=10)
    cpu = greedy(LLM(ckpt, device="cpu", num_kv_blocks=256, block_size=16), prompts, max_tokens)
    for eager in (False, True):
        llm = LLM(
            ckpt, device="cuda", dtype="float32", num_kv_blocks=256, block_size=16, max_num_seqs=16,
            max_num_batched_tokens=64, enforce_eager=eager,
        )  # fmt: skip
        got = greedy(llm, prompts, max_tokens)
        m = llm.get_metrics()
        assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
        llm.close()
        same = sum(a == b for g, c in zip(got, cpu, strict=True) for a, b in zip(g, c, strict=True))
        share = same / sum(len(c) for c in cpu)
        assert share == 1.0 or (fmt in FP8_FLAGS and share >= 0.6), (eager, share)


@pytest.mark.parametrize("fmt", ["fp8-block", "gptq-sym-desc-act"])
def test_bf16_with_fp8_kv_runs_and_stays_close(moe_models, tmp_path, fmt):
    """bf16 activations and an fp8 KV cache beside quantized experts: every request finishes, the pool
    is whole again, and the first step's logits are close to float32's: bf16 activations move more of
    them across e4m3 rounding steps (measured on one H200 at 2a5a8ce: 0.064 of the logits' norm)."""
    ckpt = write(moe_models["qwen3moe_top2"], str(tmp_path / fmt), *ENGINE_FORMATS[fmt])
    prompts, max_tokens = workload(4, n=6)
    first = {}
    for dtype in ("bfloat16", "float32"):
        llm = LLM(
            ckpt, device="cuda", dtype=dtype, kv_cache_dtype="fp8", num_kv_blocks=128, block_size=16, enforce_eager=True
        )
        rows: list[torch.Tensor] = []
        real = llm.runner.sample
        llm.runner.sample = lambda lg, inp, rows=rows, real=real: (rows.append(lg.float().clone()), real(lg, inp))[1]
        outs = greedy(llm, prompts, max_tokens)
        assert [len(o) for o in outs] == max_tokens
        m = llm.get_metrics()
        assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
        first[dtype] = rows[0]
        llm.close()
    a, b = first["bfloat16"], first["float32"]
    assert ((a - b).norm() / b.norm()).item() < 0.1
