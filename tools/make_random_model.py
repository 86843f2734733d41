"""Write a random-weight Hugging Face model directory (Qwen3-, Gemma-3-, Qwen3-MoE- or
Mixtral-shaped), for benchmarks without downloads.

    python tools/make_random_model.py --out /tmp/qwen3-0.6b-random --shape qwen3-0.6b
    python tools/make_random_model.py --out /tmp/qwen3-8b-random --shape qwen3-8b --device cuda
    python tools/make_random_model.py --out /tmp/gemma3-1b-random --shape gemma3-1b
    python tools/make_random_model.py --out /tmp/qwen3-30b-a3b --shape qwen3-30b-a3b --config-only

--quantize fp8-block|fp8-channel|awq|gptq writes the random model, then quantizes it with
tools/quantize_checkpoint.py's own code (`quantize_dir`) into --out: block-wise FP8 (blocks of
--quant-block square), compressed-tensors FP8 per channel, or 4-bit AWQ / GPTQ (groups of
--quant-block input rows); the tiny shapes need --quant-block 32 or less. MoE shapes (tiny-moe,
tiny-mixtral, ...) get their experts quantized too, their routers not (listed in the ignore list).

    python tools/make_random_model.py --out /tmp/tiny-fp8-block --shape tiny --quantize fp8-block --quant-block 32

--config-only writes config.json, generation_config.json and the tokenizer, no weights: run it
with LLM(..., load_format="dummy") (random weights made on the device), for shapes whose
checkpoint would take too long to write (Qwen3-30B-A3B: 57 GiB). With --quantize it writes the
format's `quantization_config` too, and load_format="dummy" makes the quantized weights' bytes on
the device (Qwen3-32B as 4-bit: `--shape qwen3-32b --config-only --quantize awq`). MoE checkpoints name every
expert's matrices, as the hub's do (mlp.experts.E.gate_proj.weight; Mixtral's
block_sparse_moe.experts.E.w1.weight).

Weights are bf16, normal(0, 0.02) (norm weights 1), generated tensor by tensor on the target
device and written straight to safetensors shards (no HF model is instantiated, so the 8B
shape takes seconds on a GPU). The tokenizer files are copied from the bundled default model
(or --tokenizer): its ids are all below the config's vocab_size, which is what matters.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time

SHAPES = {
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "qwen3-8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    "qwen3-32b": dict(
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    # Gemma 3 1B's text shape: 5 sliding-window (512) layers to 1 global, head_dim 256, one KV head
    "gemma3-1b": dict(
        family="gemma3",
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    # Qwen3-30B-A3B: 128 experts of 768, top-8 (renormalised), every layer sparse
    "qwen3-30b-a3b": dict(
        family="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    # Mixtral-8x7B's shape with 16 of its 32 layers (23.5B parameters, 43.7 GiB bf16): fits one
    # H200 with room for the KV cache
    "mixtral-8x7b-16l": dict(
        family="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        rope_theta=1e6,
    ),
    "tiny-moe": dict(
        family="qwen3_moe",
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "tiny-mixtral": dict(
        family="mixtral",
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "tiny": dict(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def with_layers(shape: str, layers: int | None) -> dict:
    """SHAPES[shape], with `layers` decoder layers if given (e.g. a short Qwen3-30B-A3B whose
    checkpoint is quick to write)."""
    out = dict(SHAPES[shape])
    if layers is not None:
        out["num_hidden_layers"] = layers
    return out


def hf_config(shape: dict, eos_token_id: int | None, bos_token_id: int | None) -> dict:
    shape = dict(shape)
    family = shape.pop("family", "qwen3")
    if family in ("gemma3", "qwen3_moe", "mixtral"):  # the config class fills the rest (layer pattern, ropes)
        from transformers import Gemma3TextConfig, MixtralConfig, Qwen3MoeConfig

        cls, arch = {
            "gemma3": (Gemma3TextConfig, "Gemma3ForCausalLM"),
            "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
            "mixtral": (MixtralConfig, "MixtralForCausalLM"),
        }[family]
        config = cls(**shape, eos_token_id=eos_token_id, bos_token_id=bos_token_id).to_dict()
        return {**config, "architectures": [arch], "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **shape,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": shape["num_hidden_layers"],
        "torch_dtype": "bfloat16",
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }


def tensor_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3ForCausalLM's (Gemma3ForCausalLM's, Qwen3MoeForCausalLM's, MixtralForCausalLM's)
    checkpoint names and shapes, in HF's order; experts one by one, as hub checkpoints name them."""
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    gemma = c.get("model_type") == "gemma3_text"
    kind = c.get("model_type")
    out = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        if gemma:  # the "sandwich": a norm before and after the MLP too
            out += [(p + "pre_feedforward_layernorm.weight", (h,)), (p + "post_feedforward_layernorm.weight", (h,))]
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
        ]
        if kind != "mixtral":
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        out.append((p + "post_attention_layernorm.weight", (h,)))
        out += _mlp_shapes(c, n, p, h, i)
    out.append(("model.norm.weight", (h,)))
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", (c["vocab_size"], h)))
    return out


def _mlp_shapes(c: dict, n: int, p: str, h: int, i: int) -> list[tuple[str, tuple[int, ...]]]:
    kind = c.get("model_type")
    if kind == "mixtral":
        e, mi = c["num_local_experts"], i
        out = [(p + "block_sparse_moe.gate.weight", (e, h))]
        for x in range(e):
            q = f"{p}block_sparse_moe.experts.{x}."
            out += [(q + "w1.weight", (mi, h)), (q + "w2.weight", (h, mi)), (q + "w3.weight", (mi, h))]
        return out
    sparse = (
        kind == "qwen3_moe"
        and n not in (c.get("mlp_only_layers") or [])
        and (n + 1) % (c.get("decoder_sparse_step") or 1) == 0
    )
    if not sparse:
        return [
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    e = c.get("num_experts") or c["num_local_experts"]
    mi = c["moe_intermediate_size"]
    out = [(p + "mlp.gate.weight", (e, h))]
    for x in range(e):
        q = f"{p}mlp.experts.{x}."
        out += [(q + "gate_proj.weight", (mi, h)), (q + "up_proj.weight", (mi, h)), (q + "down_proj.weight", (h, mi))]
    return out


def plan_shards(shapes: list[tuple[str, tuple[int, ...]]], max_shard_bytes: int) -> list[list]:
    shards, cur, size = [], [], 0
    for name, shape in shapes:
        nbytes = 2 * _numel(shape)
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += nbytes
    if cur:
        shards.append(cur)
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write_weights(out: str, config: dict, device: str, seed: int, max_shard_bytes: int) -> int:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    shards = plan_shards(tensor_shapes(config), max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards, strict=False):
        tensors = {}
        for name, shape in shard:
            if name.endswith("norm.weight"):  # scale 1: Gemma's norms multiply by (1 + w)
                fill = 0.0 if config.get("model_type") == "gemma3_text" else 1.0
                t = torch.full(shape, fill, dtype=torch.bfloat16, device=device)
            else:
                t = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen)
            tensors[name] = t.to("cpu", non_blocking=False).contiguous()
            weight_map[name] = fname
            total += 2 * _numel(shape)
        save_file(tensors, os.path.join(out, fname), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return total


def copy_tokenizer(src: str, out: str) -> tuple[int | None, int | None]:
    copied = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(src, f))]
    if not copied:
        raise SystemExit(f"no tokenizer files in {src}; pass --tokenizer DIR")
    for f in copied:
        shutil.copy(os.path.join(src, f), os.path.join(out, f))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    return tok.eos_token_id, tok.bos_token_id


QUANTIZE = ("fp8-block", "fp8-channel", "awq", "gptq")  # --quantize: tools/quantize_checkpoint.py's formats


def quantize_tool():
    """tools/quantize_checkpoint.py, imported from beside this file."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quantize_checkpoint.py")
    spec = importlib.util.spec_from_file_location("quantize_checkpoint", path)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def quantization_config(kind: str, block: int) -> dict:
    """The config.json `quantization_config` that `quantize_into(..., kind, block)` writes."""
    tool = quantize_tool()
    if kind == "fp8-block":
        return tool.quantization_config("fp8-block", "block", False, block=(block, block))
    if kind == "fp8-channel":
        return tool.quantization_config("compressed-tensors", "channel", False)
    return tool.quantization_config(kind, "channel", False, group=block)


def quantize_into(src: str, out: str, kind: str, block: int) -> None:
    """src's checkpoint quantized as `kind` (QUANTIZE) into out, by tools/quantize_checkpoint.py."""
    tool = quantize_tool()
    if kind == "fp8-block":
        tool.quantize_dir(src, out, "fp8-block", block=(block, block))
    elif kind == "fp8-channel":
        tool.quantize_dir(src, out, "compressed-tensors", weights="channel")
    else:
        tool.quantize_dir(src, out, kind, group_size=block)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory to write (created)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--device", default="auto", help="where to generate the weights: auto, cpu, cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="copy tokenizer files from here (default: the bundled model)")
    p.add_argument("--max-shard-gib", type=float, default=4.0, help="safetensors shard size")
    p.add_argument("--layers", type=int, default=None, help="override the shape's number of decoder layers")
    p.add_argument(
        "--config-only",
        action="store_true",
        help='config and tokenizer, no weights: for LLM(..., load_format="dummy")',
    )
    p.add_argument("--quantize", choices=QUANTIZE, default=None, help="write the checkpoint quantized (see above)")
    p.add_argument("--quant-block", type=int, default=128, help="--quantize: fp8 block side, awq/gptq group size")
    args = p.parse_args(argv)
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.tokenizer is None:
        from pagedllm import default_model_path

        args.tokenizer = default_model_path()
    os.makedirs(args.out, exist_ok=True)
    final = args.out
    if args.quantize and not args.config_only:  # the random model goes to a scratch directory, quantized into --out
        args.out = tempfile.mkdtemp(prefix=".unquantized-", dir=os.path.dirname(os.path.abspath(final)))
    t0 = time.time()
    eos, bos = copy_tokenizer(args.tokenizer, args.out)
    config = hf_config(with_layers(args.shape, args.layers), eos, bos)
    if args.quantize and args.config_only:  # for load_format="dummy": random bytes in the format, made on the device
        config["quantization_config"] = quantization_config(args.quantize, args.quant_block)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos}, f, indent=2)
    if args.config_only:
        total = 2 * sum(_numel(s) for _, s in tensor_shapes(config))
        print(f"wrote {args.shape}'s config and tokenizer ({total / 2**30:.2f} GiB of bf16 weights not written) "
              f"to {args.out}; load it with load_format='dummy'", file=sys.stderr)  # fmt: skip
        return 0
    total = write_weights(args.out, config, device, args.seed, int(args.max_shard_gib * 2**30))
    if args.quantize:
        try:
            quantize_into(args.out, final, args.quantize, args.quant_block)
        finally:
            shutil.rmtree(args.out)
    print(
        f"wrote {args.shape} ({total / 2**30:.2f} GiB bf16{', quantized ' + args.quantize if args.quantize else ''}) "
        f"to {final} in {time.time() - t0:.1f} s (weights generated on {device})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
