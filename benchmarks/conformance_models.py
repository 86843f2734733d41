"""The conformance matrix's models and cells (benchmarks/conformance.py runs them).

Models: a tiny float32 random-weight checkpoint of every architecture of the README's model table,
written by HF transformers (tests/helpers.py, tests/model/families.py, tests/model/test_moe.py
write the same ones the CPU tests use), one per rope type, plus the issue-29 repro model and the
shapes the kernels refuse (listed as refused cells with the reason, never dropped).

Cells: model x graph mode (whole-step graphs, piecewise, eager) x pool (large; small enough to
preempt at block sizes 8, 16, 32; max_model_len just above the longest request) x prefix caching
x async scheduling; fp8 KV cells (model x graph mode x large/small pool, against the CPU fp8
path over the GPU's scales); and a seeded random sweep of engine configurations, each against
its own eager twin.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil

import torch

from tests.helpers import TINY_SHAPE, build_model, build_tokenizer

GRAPH_MODES = ("full", "piecewise", "eager")
POOLS = ("large", "small-bs8", "small-bs16", "small-bs32", "tight-len")
MAX_NUM_SEQS = 6


def _llama_variant(rope: dict | None, out: str, *, max_pos: int = 512, std: float | None = None) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    shape = dict(TINY_SHAPE, max_position_embeddings=max_pos)
    model = LlamaForCausalLM(LlamaConfig(rope_scaling=rope, bos_token_id=None, eos_token_id=None, **shape))
    if std is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, std)
    model.save_pretrained(out, safe_serialization=True)


def _phi3(out: str, *, longrope: bool = False, head_dim: int = 16) -> None:
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(8)
    shape = dict(TINY_SHAPE, max_position_embeddings=256, hidden_size=head_dim * TINY_SHAPE["num_attention_heads"])
    extra: dict = {}
    if longrope:  # long factors (max_model_len 256 > 16); HF too, over any sequence of > 16 tokens
        half = head_dim // 2
        extra = dict(
            original_max_position_embeddings=16,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + i / half for i in range(half)],
                "long_factor": [2.0 + i / half for i in range(half)],
            },
        )
    model = Phi3ForCausalLM(Phi3Config(pad_token_id=None, eos_token_id=None, bos_token_id=None, **shape, **extra))
    model.save_pretrained(out, safe_serialization=True)


def _write(name: str, out: str) -> None:
    from tests.model.families import hf_checkpoint
    from tests.model.test_moe import hf_moe_checkpoint

    if name in ("qwen3", "qwen2", "llama"):
        build_model(name, out, eos_id=0)  # llama: llama3 rope scaling
    elif name == "llama-yarn-issue29":  # the repro model exactly
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
        _llama_variant(rope, out, max_pos=256, std=0.15)
    elif name == "llama-linear":
        _llama_variant({"rope_type": "linear", "factor": 2.0}, out)
    elif name == "llama-default":
        _llama_variant(None, out)
    elif name == "phi3-longrope":
        _phi3(out, longrope=True)
    elif name == "phi3-head96":
        _phi3(out, head_dim=96)
    elif name.startswith("windowed-"):
        hf_checkpoint(name.split("-", 1)[1], out)
    elif name in ("gemma2", "gemma3", "phi3"):
        hf_checkpoint(name, out)
    elif name in ("qwen3moe_top2", "mixtral"):
        hf_moe_checkpoint(name, out)
    else:
        raise ValueError(name)


# name -> what it covers (the README's model table, by architecture and rope type)
MODELS = {
    "qwen3": "Qwen3ForCausalLM (q/k norms, tied embeddings), default rope",
    "qwen2": "Qwen2ForCausalLM (qkv biases), default rope",
    "llama": "LlamaForCausalLM, llama3 rope scaling",
    "llama-yarn-issue29": "LlamaForCausalLM, yarn rope scaling (the issue-29 repro model, weights normal(0, 0.15))",
    "llama-linear": "LlamaForCausalLM, linear rope scaling",
    "llama-default": "LlamaForCausalLM, default rope",
    "phi3": "Phi3ForCausalLM (packed qkv / gate_up), sliding window",
    "phi3-longrope": "Phi3ForCausalLM, longrope (long factors)",
    "windowed-mistral": "MistralForCausalLM, a window on every layer",
    "windowed-qwen2": "Qwen2ForCausalLM with use_sliding_window (windows from max_window_layers)",
    "gemma2": "Gemma2ForCausalLM (soft caps, alternating windows, head_dim 32)",
    "gemma3": "Gemma3ForCausalLM (rope base per layer kind, linear scaling on global layers)",
    "qwen3moe_top2": "Qwen3MoeForCausalLM (top-2 of 8 experts, a dense layer)",
    "mixtral": "MixtralForCausalLM (top-2 of 8 experts), sliding window",
    "phi3-head96": "Phi3ForCausalLM at Phi-3-mini's head size 96",
}
# models whose start-up the GPU path refuses: the cell is listed with the reason
REFUSED = {"phi3-head96": "head_dim 96: the Triton attention kernels take power-of-two head sizes >= 16"}


def write_models(root: str) -> dict[str, str]:
    """name -> a checkpoint directory with the tests' BPE tokenizer (written once under root)."""
    tok = os.path.join(root, "tokenizer")
    if not os.path.isdir(tok):
        build_tokenizer(tok)
    dirs = {}
    for name in MODELS:
        out = os.path.join(root, name)
        if not os.path.isfile(os.path.join(out, "config.json")):
            _write(name, out)
            for f in os.listdir(tok):
                shutil.copy(os.path.join(tok, f), out)
        dirs[name] = out
    return dirs


def workload(max_pos: int) -> tuple[list[list[int]], list[int]]:
    """Six prompts of 20-200 token ids (three share a 48-token prefix, so prefix caching hits) and
    their output lengths: the longest request is 220 tokens (within every model's positions)."""
    rng = random.Random(29)
    shared = [rng.randrange(1, 370) for _ in range(48)]
    lens, outs = [20, 45, 80, 130, 200, 60], [20, 12, 20, 8, 20, 16]
    prompts = []
    for i, n in enumerate(lens):
        own = [rng.randrange(1, 370) for _ in range(n)]
        prompts.append((shared + own)[:n] if i in (2, 3, 4) else own)
    assert max(p + o for p, o in zip(lens, outs, strict=True)) <= max_pos
    return prompts, outs


def pool_settings(pool: str, need_one) -> dict:
    """Engine arguments of a pool kind. need_one(block_size, max_chunk): the blocks the longest
    request holds at once (its KV-cache groups' sum); a small pool is that plus one block, so six
    requests preempt each other."""
    if pool == "large":
        return dict(block_size=16, num_kv_blocks=1024)
    if pool == "tight-len":  # the default token budget: the whole-step graphs' largest buckets
        return dict(block_size=16, num_kv_blocks=1024, max_model_len=221)
    bs = int(pool.split("bs")[1])
    return dict(block_size=bs, num_kv_blocks=need_one(bs, 64) + 1, max_num_batched_tokens=64)


def matrix_cells() -> list[dict]:
    cells = []
    for model, mode, pool, prefix, asynch in itertools.product(
        MODELS, GRAPH_MODES, POOLS, (True, False), (True, False)
    ):
        cells.append(
            dict(kind="matrix", model=model, graphs=mode, pool=pool, prefix_caching=prefix, async_scheduling=asynch)
        )
    for model, mode, pool in itertools.product(MODELS, GRAPH_MODES, ("large", "small-bs16")):
        cells.append(dict(kind="fp8", model=model, graphs=mode, pool=pool, prefix_caching=True, async_scheduling=True))
    # the issue's own configuration: block 8 x 160 and block 16 x 80, max_num_seqs 5, default budget
    for mode, (bs, nb) in itertools.product(GRAPH_MODES, ((8, 160), (16, 80))):
        cells.append(
            dict(kind="repro", model="llama-yarn-issue29", graphs=mode, pool=f"bs{bs}x{nb}", prefix_caching=True,
                 async_scheduling=True, engine=dict(block_size=bs, num_kv_blocks=nb, max_num_seqs=5))
        )  # fmt: skip
    return cells


def sweep_cells(n: int = 50, seed: int = 0) -> list[dict]:
    """n random engine configurations over random prompt/output lengths (seeded), each run with
    CUDA graphs (a random graph mode) and again eager."""
    rng = random.Random(seed)
    names = [m for m in MODELS if m not in REFUSED]
    cells = []
    for i in range(n):
        model = rng.choice(names)
        max_pos = 256 if model not in ("qwen3", "qwen2", "llama", "llama-linear", "llama-default") else 512
        bs = rng.choice((8, 16, 32))
        num = rng.randint(1, 16)
        lens = [rng.randint(1, 160) for _ in range(num)]
        outs = [rng.randint(1, 40) for _ in range(num)]
        longest = max(p + o for p, o in zip(lens, outs, strict=True))
        engine = dict(
            block_size=bs,
            max_num_seqs=rng.randint(1, 40),
            max_num_batched_tokens=rng.choice((16, 32, 64, 100, 256, 1024, 2048, 8192)),
            max_model_len=rng.randint(longest, max_pos),
            enable_prefix_caching=rng.random() < 0.7,
            async_scheduling=rng.random() < 0.7,
        )
        engine["pool_slack"] = rng.choice((0, 1, 3, 10, 1000))  # blocks beyond the longest request's
        g = random.Random(1000 + i)
        shared = [g.randrange(1, 370) for _ in range(160)]
        prompts = [
            (shared[: g.randint(0, n)] + [g.randrange(1, 370) for _ in range(n)])[:n] if g.random() < 0.5
            else [g.randrange(1, 370) for _ in range(n)]
            for n in lens
        ]  # fmt: skip
        mode = rng.choice(("full", "piecewise"))
        cells.append(dict(kind="sweep", index=i, model=model, graphs=mode, engine=engine, prompts=prompts, outs=outs))
    return cells
