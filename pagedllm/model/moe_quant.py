"""Quantized experts: FusedExperts (model/moe.py) holding FP8 or 4-bit bytes and their scales, in the
layouts of ops/moe_quant.py (Fp8Stack, Int4Stack) that the fused kernels read (ops/fused_moe_fp8.py,
ops/fused_moe_int4.py; on CPU the reference, ops/moe_quant.py: quant_moe_ref).

Made by model/quantization.py in place of a layer's float experts, before the checkpoint loads into
them (or, for quantization="fp8", from the loaded float weights). Tensor parallelism as the float
experts: every rank holds every expert, w13's rows [gate | up] and w2's columns cut to this rank's
slice of the intermediate dimension, and the scales cut with them (whole blocks and whole groups
only, checked by model/quantization.py before anything loads).

- `Fp8FusedExperts`: e4m3 `w13_weight` [E, 2n, H], `w2_weight` [E, H, n]; `w13_weight_scale` /
  `w2_weight_scale` float32, per [bn, bk] block ([E, 2n / bn, H / bk], [E, H / bn, n / bk]) or per
  output row ([E, 2n], [E, H]; a checkpoint's per-tensor scale fills its matrix's rows).
- `Int4FusedExperts`: each expert in the dense 4-bit layout (ops/int4_linear.py): `w13_qweight`
  int32 [E, H / 8, 2n] (gate columns, then up), `w13_scales`, `w13_qzeros` [E, H / g, 2n], `w13_perm`
  [E, H] (GPTQ desc_act: each expert's rows sorted by group at load); `w2_*` likewise over n rows.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.int4_layer import sorted_rows
from pagedllm.model.int4_weights import unpack_checkpoint
from pagedllm.model.moe import FusedExperts
from pagedllm.ops.fp8_linear import FP8, quantize_rows
from pagedllm.ops.int4_linear import pack_k
from pagedllm.ops.kernels import Kernels
from pagedllm.ops.moe_quant import Fp8Stack, Int4Stack


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class _QuantizedExperts(FusedExperts):
    """A float FusedExperts' shape and TP slice, without its float weights."""

    def __init__(self, experts: FusedExperts):
        nn.Module.__init__(self)
        self.tp_rank, self.num_experts = experts.tp_rank, experts.num_experts
        self.intermediate, self.inter_per_rank = experts.intermediate, experts.inter_per_rank
        self.hidden = experts.w13_weight.shape[2]

    def stacks(self) -> tuple[Fp8Stack, Fp8Stack] | tuple[Int4Stack, Int4Stack]:
        raise NotImplementedError

    def run(self, kernels: Kernels, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.stacks()
        return kernels.fused_moe_quant(x, w13, w2, weights, ids)

    def _where(self, name: str, shard_id: int | str | None) -> tuple[int, int]:
        """(expert, part: 0 gate, 1 up, 2 down) of a per-expert checkpoint tensor."""
        if shard_id is None:
            raise ValueError(
                f"{name}: a quantized checkpoint's experts must be named one by one (mlp.experts.E.gate_proj...); "
                "packed expert tensors (experts.gate_up_proj) are read unquantized only"
            )
        expert, part = divmod(int(shard_id), 3)
        if expert >= self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}; the config has {self.num_experts} experts")
        return expert, part


class Fp8FusedExperts(_QuantizedExperts):
    w13_weight_scale: nn.Parameter
    w2_weight_scale: nn.Parameter

    def __init__(self, experts: FusedExperts, block: tuple[int, int] | None, quantize: bool):
        """experts' shape with e4m3 weights; quantize: from experts' loaded weights, one scale per output
        row (quantization="fp8"), else empty for an FP8 checkpoint to load into."""
        super().__init__(experts)
        self.block = block
        e, n, h = self.num_experts, self.inter_per_rank, self.hidden
        dev = experts.w13_weight.device
        for name, rows, cols in (("w13", 2 * n, h), ("w2", h, n)):
            if quantize:
                w = experts.get_parameter(f"{name}_weight").data
                pairs = [quantize_rows(w[i]) for i in range(e)]  # expert by expert: one float copy at a time
                q, scale = torch.stack([p[0] for p in pairs]), torch.stack([p[1].view(-1) for p in pairs])
            else:
                q = torch.empty(e, rows, cols, dtype=FP8, device=dev)
                shape = (e, rows) if block is None else (e, rows // block[0], cols // block[1])
                scale = torch.zeros(shape, dtype=torch.float32, device=dev)
            self.register_parameter(f"{name}_weight", _param(q))
            self.register_parameter(f"{name}_weight_scale", _param(scale))

    def stacks(self) -> tuple[Fp8Stack, Fp8Stack]:
        return (
            Fp8Stack(self.w13_weight, self.w13_weight_scale, self.block),
            Fp8Stack(self.w2_weight, self.w2_weight_scale, self.block),
        )

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        expert, part = self._where(name, shard_id)
        if name in ("w13_weight", "w2_weight"):
            super().load_weight(name, loaded, shard_id)
            return
        n, r = self.inter_per_rank, self.tp_rank
        dst = self.get_parameter(name).data[expert]
        values = loaded.float().to(dst.device)
        if self.block is None:  # one scale per output row, or one per tensor
            values = values.reshape(-1)
            rows = self.hidden if part == 2 else self.intermediate
            if values.numel() not in (1, rows):
                raise ValueError(f"{name} of expert {expert}: {values.numel()} scales for {rows} output rows")
            if part != 2:
                dst = dst.narrow(0, part * n, n)
                values = values if values.numel() == 1 else values.narrow(0, r * n, n)
            dst.copy_(values.expand(dst.shape[0]))
            return
        bn, bk = self.block
        rows, cols = (self.hidden, self.intermediate) if part == 2 else (self.intermediate, self.hidden)
        if tuple(values.shape) != (rows // bn, cols // bk):
            raise ValueError(
                f"{name} of expert {expert} has shape {tuple(values.shape)}, expected {(rows // bn, cols // bk)} "
                f"(blocks of {bn}x{bk})"
            )
        if part == 2:
            dst.copy_(values.narrow(1, r * n // bk, n // bk))
        else:
            dst.narrow(0, part * n // bn, n // bn).copy_(values.narrow(0, r * n // bn, n // bn))


class Int4FusedExperts(_QuantizedExperts):
    w13_qweight: nn.Parameter
    w13_scales: nn.Parameter
    w13_qzeros: nn.Parameter
    w13_perm: nn.Parameter | None
    w2_qweight: nn.Parameter
    w2_scales: nn.Parameter
    w2_qzeros: nn.Parameter
    w2_perm: nn.Parameter | None

    def __init__(self, experts: FusedExperts, groups: tuple[int, int], scale_dtype: torch.dtype, desc_act: bool):
        """Empty packed experts for a 4-bit checkpoint; groups: this rank's group sizes of w13 (over H)
        and w2 (over n); desc_act: a row order per expert (GPTQ's g_idx)."""
        super().__init__(experts)
        self.groups = groups
        e, n, h = self.num_experts, self.inter_per_rank, self.hidden
        dev = experts.w13_weight.device
        for name, k, cols, group in (("w13", h, 2 * n, groups[0]), ("w2", n, h, groups[1])):
            assert k % group == 0 and group % 8 == 0, (name, k, group)
            self.register_parameter(
                f"{name}_qweight", _param(torch.zeros(e, k // 8, cols, dtype=torch.int32, device=dev))
            )
            self.register_parameter(
                f"{name}_scales", _param(torch.zeros(e, k // group, cols, dtype=scale_dtype, device=dev))
            )
            self.register_parameter(
                f"{name}_qzeros", _param(torch.zeros(e, k // group, cols, dtype=torch.uint8, device=dev))
            )
            perm = _param(torch.zeros(e, k, dtype=torch.int32, device=dev)) if desc_act else None
            self.register_parameter(f"{name}_perm", perm)
        self.orders: dict[int, torch.Tensor] = {}  # expert -> the input order its gate or up set (w13)

    def stacks(self) -> tuple[Int4Stack, Int4Stack]:
        return (
            Int4Stack(self.w13_qweight, self.w13_scales, self.w13_qzeros, self.w13_perm, self.groups[0]),
            Int4Stack(self.w2_qweight, self.w2_scales, self.w2_qzeros, self.w2_perm, self.groups[1]),
        )

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        raise ValueError(f"{name}: a 4-bit checkpoint's experts load through load_int4 (qweight, qzeros, scales)")

    def load_int4(
        self, name: str, parts: dict[str, torch.Tensor], shard_id: int | str | None, method: str, zero_offset: int
    ) -> None:
        """One expert matrix's AWQ / GPTQ tensors into this rank's slice of its expert."""
        expert, part = self._where(name, shard_id)
        q, zeros, scales, g_idx = unpack_checkpoint(method, parts, zero_offset)
        n, r, h = self.inter_per_rank, self.tp_rank, self.hidden
        k_total, cols_total = (self.intermediate, h) if part == 2 else (h, self.intermediate)
        if tuple(q.shape) != (k_total, cols_total) or k_total % scales.shape[0]:
            raise ValueError(
                f"4-bit expert {name}: q {tuple(q.shape)} and scales {tuple(scales.shape)} do not match its "
                f"{k_total} input rows x {cols_total} outputs"
            )
        prefix, group = ("w2", self.groups[1]) if part == 2 else ("w13", self.groups[0])
        k_first, k_here = (r * n, n) if part == 2 else (0, h)
        cols = slice(0, h) if part == 2 else slice(r * n, (r + 1) * n)
        dst = slice(0, h) if part == 2 else slice(part * n, (part + 1) * n)
        perm, first_group = sorted_rows(name, g_idx, scales.shape[0], k_first, k_here, k_total, group)
        self._set_order(name, prefix, expert, part, perm, k_here)
        q_rows = q[k_first : k_first + k_here]
        if perm is not None:
            q_rows = q_rows[perm.long()]
        group_rows = slice(first_group, first_group + k_here // group)
        qweight = self.get_parameter(f"{prefix}_qweight").data[expert]
        qweight[:, dst] = pack_k(q_rows[:, cols]).to(qweight.device)
        s = self.get_parameter(f"{prefix}_scales").data[expert]
        s[:, dst] = scales[group_rows, cols].to(s.device, s.dtype)
        z = self.get_parameter(f"{prefix}_qzeros").data[expert]
        z[:, dst] = zeros[group_rows, cols].to(z.device, torch.uint8)

    def _set_order(self, name: str, prefix: str, expert: int, part: int, perm: torch.Tensor | None, k: int) -> None:
        """The expert's input order (GPTQ desc_act); gate and up read x once, so they must agree."""
        param = self.w2_perm if prefix == "w2" else self.w13_perm
        if param is None:
            if perm is not None:
                raise ValueError(
                    f"4-bit expert {name}: its g_idx permutes the input rows, but the checkpoint's "
                    "quantization_config has desc_act false"
                )
            return
        order = perm if perm is not None else torch.arange(k, dtype=torch.int32)
        if part != 2:
            if expert in self.orders and not torch.equal(self.orders[expert], order):
                raise ValueError(
                    f"4-bit expert {name}: its gate and up matrices' input orders (GPTQ desc_act g_idx) differ; "
                    "the kernel reads the input in one order per expert"
                )
            self.orders[expert] = order
        param.data[expert].copy_(order.to(param.device))
