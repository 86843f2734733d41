#!/usr/bin/env python3
"""Train pagedllm's default model: a small Qwen3-architecture causal LM on the
Python standard library's own source code.

What it does (all seeded, see ``--seed``):

1. Gathers the ``.py`` files of the running interpreter's standard library
   (``sysconfig.get_paths()["stdlib"]``), leaving out test suites (any folder
   named ``test``, ``tests`` or ``idle_test``: ``test/``, ``lib2to3/tests``,
   ``idlelib/idle_test``, ...), ``site-packages``/``dist-packages``,
   ``__pycache__`` and, unless ``--keep-generated``, two kinds of generated
   data files (``pydoc_data/`` and the ``encodings/`` charmap tables).
2. Sorts them by relative path and splits them *by file* into train and
   validation (``--val-fraction``, seeded shuffle).
3. Trains a byte-level BPE tokenizer (``tokenizers``) on the training files,
   vocabulary ``--vocab-size`` including the special tokens
   ``<|endoftext|>`` (eos/pad), ``<|im_start|>`` and ``<|im_end|>``, and writes
   ``tokenizer.json`` and ``tokenizer_config.json`` (with a ChatML template).
4. Joins the files with ``<|endoftext|>`` and trains a randomly initialised
   ``transformers.Qwen3ForCausalLM`` (tied embeddings) with a plain PyTorch
   loop: AdamW, linear warm-up + cosine decay, bf16 autocast, gradient
   clipping.  Training stops at ``--steps``/``--max-epochs`` or when the
   wall-clock budget ``--minutes`` is spent, whichever comes first; the
   cosine schedule follows whichever of the two budgets is further along, so
   the learning rate is annealed when training ends either way.  Validation
   loss is measured regularly and the best-validation weights are kept.
5. Saves the model in bfloat16 (``save_pretrained``, safetensors),
   ``generation_config.json`` and ``train_log.json``.

The shipped model (pagedllm/default_model, see its README.md) was trained with
``--minutes 5 --align-windows line --pretokenizer v2`` (scripts/retrain_default_model.sh);
the epoch cap (16, the default) stopped it, not the clock.

With ``--sweep`` the script prepares the data once and then trains several
configurations in parallel child processes (on the same GPU), and copies the
one with the lowest validation loss to ``--out``.

Reproducibility: the data, split, tokenizer and batch order depend only on
the Python version (its stdlib) and ``--seed``; the number of steps depends
on the hardware only if the wall-clock budget binds before ``--steps`` /
``--max-epochs`` (``train_log.json`` records which one stopped training).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# identifiers | numbers | punctuation runs (may take one leading space) | whitespace runs
PRETOKENIZE_PATTERNS = {
    # v1 (the shipped model): a newline and the next line's indentation form one token
    "v1": r"[\p{L}_][\p{L}\p{N}_]*|\p{N}+| ?[^\s\p{L}\p{N}_]+|\s+",
    # v2: newlines and indentation are separate tokens, so a prompt that ends in "\n" is
    # tokenized as in training text (with v1 a bare "\n" token implies an unindented next line)
    "v2": r"[\p{L}_][\p{L}\p{N}_]*|\p{N}+| ?[^\s\p{L}\p{N}_]+|\n+|[^\S\n]+",
}

EXCLUDED_DIR_NAMES = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
MODEL_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "train_log.json",
]


def log(msg: str, tag: str = "") -> None:
    print(f"{tag}{msg}", flush=True)


# --------------------------------------------------------------------------- data


def is_generated(rel: str) -> bool:
    """Generated data files of the stdlib: pydoc's topic dump and charmap tables."""
    return rel.split("/")[0] == "pydoc_data"


def gather_files(stdlib: str, keep_generated: bool) -> tuple[list[tuple[str, str]], dict]:
    root = Path(stdlib)
    files: list[tuple[str, str]] = []
    skipped = {"test_dirs": 0, "package_dirs": 0, "generated": 0, "undecodable": 0}
    for dirpath, dirnames, filenames in os.walk(root):
        kept = []
        for d in dirnames:
            if d in EXCLUDED_DIR_NAMES:
                key = "package_dirs" if d.endswith("-packages") else "test_dirs"
                skipped[key] += sum(1 for _, _, fs in os.walk(Path(dirpath) / d) for f in fs if f.endswith(".py"))
            else:
                kept.append(d)
        dirnames[:] = sorted(kept)
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            path = Path(dirpath) / fn
            rel = path.relative_to(root).as_posix()
            raw = path.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                try:
                    text = raw.decode("latin-1")
                except UnicodeDecodeError:
                    skipped["undecodable"] += 1
                    continue
            if not keep_generated and (
                is_generated(rel) or (rel.startswith("encodings/") and "Python Character Mapping Codec" in text[:600])
            ):
                skipped["generated"] += 1
                continue
            text = text.replace("\r\n", "\n")
            files.append((rel, text))
    files.sort(key=lambda x: x[0])
    return files, skipped


def split_files(files, val_fraction: float, seed: int):
    idx = list(range(len(files)))
    random.Random(seed).shuffle(idx)
    n_val = max(1, round(len(files) * val_fraction))
    val_idx = set(idx[:n_val])
    train = [f for i, f in enumerate(files) if i not in val_idx]
    val = [f for i, f in enumerate(files) if i in val_idx]
    return train, val


def train_tokenizer(texts: list[str], vocab_size: int, max_chars: int, pretokenizer: str = "v1"):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # Byte-level BPE whose pre-tokenizer never glues a space to the *following* identifier
    # (unlike GPT-2's " ?\p{L}+"), so prompts that end in a space ("import ", "def ") are
    # tokenized exactly as in training text: "import os" -> "import", " ", "os".
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERNS[pretokenizer]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if max_chars > 0:
        subset, n = [], 0
        for t in texts:
            if n >= max_chars:
                break
            subset.append(t)
            n += len(t)
        texts = subset
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def write_tokenizer_files(tok, out: Path, model_max_length: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {}
    for s in SPECIAL_TOKENS:
        added[str(tok.token_to_id(s))] = {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    cfg = {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOT,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": EOT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def encode_docs(tok, texts: list[str]) -> np.ndarray:
    eot = tok.token_to_id(EOT)
    encs = tok.encode_batch(texts, add_special_tokens=False)
    total = sum(len(e.ids) + 1 for e in encs)
    arr = np.empty(total, dtype=np.int32)
    pos = 0
    for e in encs:  # doc, <|endoftext|>, doc, <|endoftext|>, ...
        n = len(e.ids)
        arr[pos : pos + n] = e.ids
        arr[pos + n] = eot
        pos += n + 1
    return arr


def prepare_data(args, cache: Path) -> dict:
    """Build (or load from ``cache``) tokenizer files and token streams."""
    meta_path = cache / "data_meta.json"
    if meta_path.exists():
        log(f"data: reusing {cache}", args.tag)
        return json.loads(meta_path.read_text())
    t0 = time.time()
    stdlib = args.stdlib or sysconfig.get_paths()["stdlib"]
    files, skipped = gather_files(stdlib, args.keep_generated)
    train, val = split_files(files, args.val_fraction, args.seed)
    log(
        f"data: {len(files)} files from {stdlib} ({sum(len(t) for _, t in files) / 1e6:.2f} M chars), "
        f"train {len(train)} / val {len(val)} files; skipped {skipped}",
        args.tag,
    )
    t1 = time.time()
    tok = train_tokenizer([t for _, t in train], args.vocab_size, args.tokenizer_max_chars, args.pretokenizer)
    log(f"tokenizer: vocab {tok.get_vocab_size()} trained in {time.time() - t1:.1f}s", args.tag)
    cache.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(tok, cache, args.model_max_length)
    t2 = time.time()
    train_ids = encode_docs(tok, [t for _, t in train])
    val_ids = encode_docs(tok, [t for _, t in val])
    np.save(cache / "train_ids.npy", train_ids)
    np.save(cache / "val_ids.npy", val_ids)
    train_chars = sum(len(t) for _, t in train)
    train_bytes = sum(len(t.encode("utf-8")) for _, t in train)
    log(
        f"tokenized in {time.time() - t2:.1f}s: train {len(train_ids)} tokens, val {len(val_ids)} tokens, "
        f"{train_bytes / len(train_ids):.2f} bytes/token",
        args.tag,
    )
    meta = {
        "python_version": platform.python_version(),
        "stdlib_path": stdlib,
        "excluded_dir_names": sorted(EXCLUDED_DIR_NAMES),
        "generated_files_excluded": not args.keep_generated,
        "n_files": len(files),
        "n_train_files": len(train),
        "n_val_files": len(val),
        "skipped": skipped,
        "val_files": [r for r, _ in val],
        "total_chars": sum(len(t) for _, t in files),
        "train_chars": train_chars,
        "train_bytes": train_bytes,
        "val_bytes": sum(len(t.encode("utf-8")) for _, t in val),
        "train_tokens": int(len(train_ids)),
        "val_tokens": int(len(val_ids)),
        "vocab_size": tok.get_vocab_size(),
        "tokenizer_train_chars": args.tokenizer_max_chars,
        "pretokenizer": args.pretokenizer,
        "pretokenize_pattern": PRETOKENIZE_PATTERNS[args.pretokenizer],
        "seed": args.seed,
        "val_fraction": args.val_fraction,
        "prep_seconds": time.time() - t0,
    }
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


# --------------------------------------------------------------------------- model


def build_config(args, vocab_size: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        hidden_act="silu",
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,  # transformers 4.x name
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},  # transformers 5.x
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=True,
        use_cache=True,
        use_sliding_window=False,
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )


def add_residual_dropout(model, p: float) -> list:
    """Dropout on each attention/MLP branch output, via forward hooks (training only).

    Hooks are not part of the saved model, so the checkpoint stays a plain Qwen3.
    """
    import torch.nn.functional as F

    handles = []
    if p <= 0:
        return handles

    def hook(module, inputs, output):
        if not module.training:
            return output
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, True),) + tuple(output[1:])
        return F.dropout(output, p, True)

    for layer in model.model.layers:
        handles.append(layer.self_attn.register_forward_hook(hook))
        handles.append(layer.mlp.register_forward_hook(hook))
    return handles


def lr_at(step: int, progress: float, warm_progress: float, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    span = max(1e-9, 1.0 - warm_progress)
    p = min(1.0, max(0.0, (progress - warm_progress) / span))
    min_lr = args.lr * args.min_lr_ratio
    return min_lr + (args.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))


def evaluate(model, ids, seq_len, batch_size, device, amp, max_tokens: int = 0) -> tuple[float, int]:
    """Mean next-token loss (nats/token) over non-overlapping windows of ``ids``."""
    import torch
    import torch.nn.functional as F

    model.eval()
    n_win = (len(ids) - 1) // seq_len
    if max_tokens > 0:
        n_win = min(n_win, max(1, max_tokens // seq_len))
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(0, n_win, batch_size):
            rows = range(b, min(n_win, b + batch_size))
            x = torch.stack([ids[r * seq_len : r * seq_len + seq_len] for r in rows]).to(device)
            y = torch.stack([ids[r * seq_len + 1 : r * seq_len + seq_len + 1] for r in rows]).to(device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1), reduction="sum")
            total += loss.item()
            count += y.numel()
    model.train()
    return total / max(1, count), count


def train_one(args) -> dict:
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import Qwen3ForCausalLM

    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.data_cache) if args.data_cache else out / "_data"
    meta = prepare_data(args, cache)
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        if cache.resolve() != out.resolve():
            shutil.copy(cache / fn, out / fn)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    amp = device.type == "cuda" or args.cpu_bf16
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    gpu_name = torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu"

    train_ids = torch.from_numpy(np.load(cache / "train_ids.npy").astype(np.int64))
    val_ids = torch.from_numpy(np.load(cache / "val_ids.npy").astype(np.int64))
    train_ids_dev = train_ids.to(device)
    arange_dev = torch.arange(args.seq_len + 1, device=device)
    vocab = meta["vocab_size"]
    assert vocab <= args.vocab_size

    config = build_config(args, args.vocab_size)
    model = Qwen3ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())  # tied: counted once
    n_embed = model.model.embed_tokens.weight.numel()
    model.to(device)
    model.train()
    hooks = add_residual_dropout(model, args.dropout)
    fwd = torch.compile(model) if args.compile else model

    decay, no_decay = [], []
    for p in model.parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )

    tokens_per_step = args.batch_size * args.seq_len
    epoch_steps = len(train_ids) / tokens_per_step
    max_steps = args.steps if args.steps > 0 else 10**12
    if args.max_epochs > 0:
        max_steps = min(max_steps, max(1, int(round(args.max_epochs * epoch_steps))))
    budget_s = args.minutes * 60.0
    eval_every = args.eval_every or max(25, int(epoch_steps * 2))
    log(
        f"model: {n_params / 1e6:.3f} M params ({n_embed / 1e6:.3f} M in the tied embedding), device {device} "
        f"({gpu_name}), {tokens_per_step} tokens/step, {epoch_steps:.1f} steps/epoch, "
        f"max_steps {max_steps if max_steps < 10**12 else 'inf'}, budget {args.minutes} min, "
        f"dropout {args.dropout}, eval every {eval_every} steps",
        args.tag,
    )

    gen = np.random.default_rng(args.seed)
    n_windows = len(train_ids) - args.seq_len - 1
    starts_pool = None
    if args.align_windows == "line":
        # Windows start where a file or a line starts, like a prompt does (with the v1
        # pre-tokenizer a newline token carries the next line's indentation, so there only
        # unindented lines start right after one).
        from tokenizers import Tokenizer

        tk = Tokenizer.from_file(str(cache / "tokenizer.json"))
        nl = [
            i
            for i in range(tk.get_vocab_size())
            if i == tk.token_to_id(EOT)
            or (lambda t: t.endswith("\n") and t.strip() == "")(tk.decode([i], skip_special_tokens=False))
        ]
        prev = np.isin(np.load(cache / "train_ids.npy")[: n_windows - 1], np.array(nl, dtype=np.int32))
        starts_pool = np.concatenate([[0], np.nonzero(prev)[0] + 1]).astype(np.int64)
        log(f"aligned windows: {len(starts_pool)} start positions ({len(nl)} newline/eot token ids)", args.tag)
    evals = []
    best = {"val_loss": float("inf"), "step": -1, "state": None}
    recent = []
    history = []
    step = 0
    warm_progress = 0.0
    tokens_seen = 0
    stop_reason = "steps"
    t_loop = time.time()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def do_eval(step_now):
        v, n_tok = evaluate(model, val_ids, args.seq_len, args.eval_batch_size, device, amp)
        evals.append({"step": step_now, "val_loss": v, "elapsed_s": time.time() - t_loop, "tokens_seen": tokens_seen})
        if v < best["val_loss"]:
            best["val_loss"] = v
            best["step"] = step_now
            best["state"] = {k: t.detach().clone() for k, t in model.state_dict().items()}
        log(f"  eval step {step_now}: val {v:.4f} (best {best['val_loss']:.4f} @ {best['step']})", args.tag)
        return v

    while True:
        elapsed = time.time() - t_loop
        progress = max(step / max_steps, elapsed / budget_s if budget_s > 0 else 0.0)
        if step >= max_steps:
            stop_reason = "steps" if args.steps > 0 and args.steps == max_steps else "max_epochs"
            break
        if budget_s > 0 and elapsed >= budget_s:
            stop_reason = "wall_clock"
            break
        if step == args.warmup_steps:
            warm_progress = progress
        lr = lr_at(step, progress, warm_progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        if starts_pool is None:
            starts = gen.integers(0, n_windows, size=args.batch_size)
        else:
            starts = starts_pool[gen.integers(0, len(starts_pool), size=args.batch_size)]
        idx = torch.from_numpy(starts).to(device)[:, None] + arange_dev[None, :]
        batch = train_ids_dev[idx]
        x, y = batch[:, :-1], batch[:, 1:]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits = fwd(input_ids=x).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        tokens_seen += tokens_per_step
        if step % args.log_every == 0 or step == 1:
            lv = loss.item()
            recent.append(lv)
            recent = recent[-args.running_mean :]
            history.append(
                {"step": step, "loss": lv, "lr": lr, "grad_norm": float(gnorm), "elapsed_s": time.time() - t_loop}
            )
            log(
                f"step {step} loss {lv:.4f} lr {lr:.2e} gnorm {float(gnorm):.2f} "
                f"progress {progress:.3f} {tokens_seen / (time.time() - t_loop) / 1e3:.0f}k tok/s "
                f"epoch {tokens_seen / len(train_ids):.1f}",
                args.tag,
            )
        if step % eval_every == 0:
            do_eval(step)
    sync()
    train_seconds = time.time() - t_loop
    final_val = do_eval(step) if (not evals or evals[-1]["step"] != step) else evals[-1]["val_loss"]
    # Running mean of the last logged training losses (with dropout, if any).
    train_loss_running = float(np.mean(recent)) if recent else float("nan")

    for h in hooks:
        h.remove()
    # Keep the best-validation weights.
    model.load_state_dict(best["state"])
    # Eval-mode (no dropout) train loss on the same number of tokens as the validation set.
    train_loss_eval, _ = evaluate(
        model, train_ids, args.seq_len, args.eval_batch_size, device, amp, max_tokens=len(val_ids)
    )
    model = model.to(torch.bfloat16)
    val_bf16, n_val_eval = evaluate(model, val_ids, args.seq_len, args.eval_batch_size, device, amp)
    train_bf16, _ = evaluate(model, train_ids, args.seq_len, args.eval_batch_size, device, amp, max_tokens=len(val_ids))
    model.config.attention_dropout = 0.0
    model.save_pretrained(out, safe_serialization=True)
    # Compatibility keys for readers of transformers-4-style configs.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("torch_dtype", "bfloat16")
    cfg.setdefault("rope_theta", args.rope_theta)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    gen_cfg = {
        "bos_token_id": None,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.95,
        "transformers_version": transformers.__version__,
    }
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")

    result = {
        "tag": args.tag.strip(),
        "args": {k: v for k, v in vars(args).items() if k not in ("sweep",)},
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "data": {k: v for k, v in meta.items() if k != "val_files"},
        "val_files": meta["val_files"],
        "n_params": n_params,
        "n_params_embedding": n_embed,
        "n_params_non_embedding": n_params - n_embed,
        "safetensors_bytes": (out / "model.safetensors").stat().st_size,
        "steps": step,
        "max_steps": max_steps if max_steps < 10**12 else None,
        "stop_reason": stop_reason,
        "tokens_per_step": tokens_per_step,
        "tokens_seen": tokens_seen,
        "epochs_seen": tokens_seen / len(train_ids),
        "train_seconds": train_seconds,
        "total_seconds": time.time() - t_start,
        "tokens_per_second": tokens_seen / train_seconds,
        "final_step_val_loss": final_val,
        "best_val_step": best["step"],
        "best_val_loss": best["val_loss"],
        "train_loss_running_mean_last": train_loss_running,
        "train_loss_running_mean_window": len(recent) * args.log_every,
        "saved_weights": "best validation checkpoint",
        "saved_train_loss_eval_mode": train_loss_eval,
        "saved_val_loss_bf16": val_bf16,
        "saved_train_loss_bf16": train_bf16,
        "saved_val_perplexity_bf16": math.exp(val_bf16),
        "val_tokens_evaluated": n_val_eval,
        # bits per UTF-8 byte, using the whole validation stream's bytes/token ratio
        "val_bits_per_byte_bf16": val_bf16 / math.log(2) * len(val_ids) / meta["val_bytes"],
        "evals": evals,
        "history": history,
        "device": str(device),
        "gpu_name": gpu_name,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "stdlib_python_version": meta["python_version"],
    }
    try:
        import tokenizers

        result["tokenizers_version"] = tokenizers.__version__
    except Exception:  # pragma: no cover
        pass
    (out / "train_log.json").write_text(json.dumps(result, indent=2) + "\n")
    log(
        f"done: {step} steps ({stop_reason}), {tokens_seen / 1e6:.1f} M tokens, {train_seconds:.0f}s; "
        f"best val {best['val_loss']:.4f} @ step {best['step']}, final-step val {final_val:.4f}, "
        f"saved bf16 val {val_bf16:.4f} (ppl {math.exp(val_bf16):.2f}), train(eval mode) {train_bf16:.4f}, "
        f"running train {train_loss_running:.4f}",
        args.tag,
    )
    return result


# --------------------------------------------------------------------------- sweep


def run_sweep(args, argv: list[str]) -> None:
    """Prepare data once, train each ``epochs:dropout`` config in parallel, keep the best."""
    out = Path(args.out)
    work = Path(args.sweep_dir) if args.sweep_dir else out.parent / (out.name + "_sweep")
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "data"
    prepare_data(args, cache)
    configs = []
    for item in args.sweep.split(","):
        ep, dr = item.split(":")
        configs.append((float(ep), float(dr)))
    # Pass the original arguments through, minus the sweep ones.
    base, skip = [], False
    drop = {"--sweep", "--sweep-dir", "--out", "--max-epochs", "--dropout", "--data-cache", "--tag"}
    for a in argv:
        if skip:
            skip = False
            continue
        key = a.split("=")[0]
        if key in drop:
            skip = "=" not in a
            continue
        base.append(a)
    procs = []
    for i, (ep, dr) in enumerate(configs):
        run_dir = work / f"run{i}"
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            *base,
            "--out",
            str(run_dir),
            "--data-cache",
            str(cache),
            "--max-epochs",
            str(ep),
            "--dropout",
            str(dr),
            "--tag",
            f"[run{i} ep{ep:g} do{dr:g}] ",
        ]
        log(f"sweep: launching {' '.join(cmd)}")
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // len(configs))))
        procs.append(subprocess.Popen(cmd, env=env))
    # Children stop themselves after --minutes; kill any that hang well past that.
    deadline = time.time() + args.minutes * 60 + args.sweep_grace
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            p.kill()
            rcs.append(p.wait())
    results = []
    for i, rc in enumerate(rcs):
        lp = work / f"run{i}" / "train_log.json"
        if rc == 0 and lp.exists():
            results.append((i, json.loads(lp.read_text())))
        else:
            log(f"sweep: run{i} failed with rc {rc}")
    if not results:
        raise SystemExit("sweep: every run failed")
    best_i, best = min(results, key=lambda r: r[1]["saved_val_loss_bf16"])
    out.mkdir(parents=True, exist_ok=True)
    for fn in MODEL_FILES:
        shutil.copy(work / f"run{best_i}" / fn, out / fn)
    summary = [
        {
            "run": i,
            "max_epochs": r["args"]["max_epochs"],
            "dropout": r["args"]["dropout"],
            "steps": r["steps"],
            "stop_reason": r["stop_reason"],
            "epochs_seen": r["epochs_seen"],
            "best_val_step": r["best_val_step"],
            "final_step_val_loss": r["final_step_val_loss"],
            "saved_val_loss_bf16": r["saved_val_loss_bf16"],
            "saved_train_loss_bf16": r["saved_train_loss_bf16"],
            "train_loss_running_mean_last": r["train_loss_running_mean_last"],
            "train_seconds": r["train_seconds"],
            "tokens_per_second": r["tokens_per_second"],
            "chosen": i == best_i,
        }
        for i, r in results
    ]
    best["sweep"] = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "selection": "lowest saved_val_loss_bf16",
        "runs": summary,
    }
    (out / "train_log.json").write_text(json.dumps(best, indent=2) + "\n")
    for s in summary:
        log(f"sweep: {s}")
    log(f"sweep: chose run{best_i}; files in {out}")


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", required=True, help="output directory (model + tokenizer + train_log.json)")
    p.add_argument("--minutes", type=float, default=7.0, help="wall-clock budget of the training loop")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    p.add_argument(
        "--max-epochs",
        type=float,
        default=16.0,
        help="stop after this many passes over the training tokens (0: no limit)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--stdlib", default="", help="stdlib folder (default: sysconfig's, of this Python)")
    p.add_argument("--keep-generated", action="store_true", help="keep pydoc_data/ and encodings charmap tables")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument(
        "--tokenizer-max-chars",
        type=int,
        default=0,
        help="train the tokenizer on the first N chars of training files only (0: all)",
    )
    p.add_argument(
        "--pretokenizer",
        choices=sorted(PRETOKENIZE_PATTERNS),
        default="v1",
        help="split pattern before byte-level BPE (see PRETOKENIZE_PATTERNS)",
    )
    p.add_argument("--model-max-length", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=320)
    p.add_argument("--intermediate", type=int, default=960)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-batch-size", type=int, default=32)
    p.add_argument(
        "--align-windows",
        choices=["none", "line"],
        default="none",
        help="where training windows start: anywhere (none), or only at the start of a file or of "
        "a line (line; with --pretokenizer v1 only unindented lines, since a newline and the next "
        "line's indentation share a token), which matches prompts such as 'import ' or 'def '",
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.15, help="residual-branch dropout during training")
    p.add_argument("--eval-every", type=int, default=50, help="steps between validation runs (0: ~2 epochs)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--running-mean", type=int, default=8, help="logged losses in the running train-loss mean")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--cpu", action="store_true", help="train on CPU even if CUDA is there")
    p.add_argument("--cpu-bf16", action="store_true", help="bf16 autocast on CPU too")
    p.add_argument("--data-cache", default="", help="folder for/with the tokenizer and token streams")
    p.add_argument(
        "--sweep",
        default="",
        help="comma-separated EPOCHS:DROPOUT configs to train in parallel; "
        "the lowest validation loss is copied to --out",
    )
    p.add_argument("--sweep-dir", default="", help="work folder of --sweep (default: OUT_sweep)")
    p.add_argument(
        "--sweep-grace", type=float, default=150.0, help="seconds past --minutes before a sweep run is killed"
    )
    p.add_argument("--tag", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.sweep:
        run_sweep(args, argv)
    else:
        train_one(args)


if __name__ == "__main__":
    main()
