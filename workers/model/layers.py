"""Building blocks of a Llama-family decoder, written to be sharded across TP ranks.

Each parameter that comes from a checkpoint has a `weight_loader(param, source,
shard)` that copies just this rank's slice out of a lazily read tensor
(`source[a:b]` reads only those rows from safetensors).

    ColumnParallelLinear: weight rows split over ranks, no communication.
    RowParallelLinear:    weight columns split; outputs are partial sums that the
                          caller all-reduces (so it can overlap that with other work).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.distributed.parallel import ParallelContext, shard_range
from tandem.workers.kernels import cpu_kernels, gpu_kernels
from tandem.workers.kernels.cpu_gemm import PackedWeight, pack_linear_weights
from tandem.workers.quant import linear as qlinear
from tandem.workers.quant.scheme import QuantScheme


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    assert param.shape == loaded.shape, f"shape {tuple(loaded.shape)} != parameter {tuple(param.shape)}"
    param.data.copy_(loaded)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split over TP ranks; several logical outputs may be
    merged into one GEMM (q|k|v, gate|up), each split separately."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, ctx: ParallelContext,
                 dtype: torch.dtype, quant_scheme: QuantScheme | None = None) -> None:
        super().__init__()
        self.ctx = ctx
        self.out_sizes = [s // ctx.tp_size for s in out_sizes]  # per-rank size of each part
        for s in out_sizes:
            assert s % ctx.tp_size == 0, f"output size {s} does not split over {ctx.tp_size} ranks"
        self.quant: QuantScheme | None = None  # quantized weights and their scales (workers/quant/linear.py)
        self.weight_scale: nn.Parameter | None = None
        self.input_scale: nn.Parameter | None = None
        if quant_scheme is not None and not quant_scheme.online:
            qlinear.init_params(self, sum(self.out_sizes), in_features, quant_scheme)
        else:
            self.weight = nn.Parameter(torch.empty(sum(self.out_sizes), in_features, dtype=dtype),
                                       requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(sum(self.out_sizes), dtype=dtype), requires_grad=False) if bias else None
        self.packed: PackedWeight | None = None  # MKL's layout of the weight (cpu_gemm.py)

    def part_offset(self, part: int) -> int:
        return sum(self.out_sizes[:part])

    def part_start(self, part: int) -> int:
        """The first checkpoint row of this rank's slice of `part`."""
        return self.ctx.tp_rank * self.out_sizes[part]

    def weight_loader(self, param: torch.Tensor, source: Any, part: int = 0) -> None:
        size, start, offset = self.out_sizes[part], self.part_start(part), self.part_offset(part)
        if param is self.weight_scale:
            qlinear.load_row_scales(param, source, start, size, offset, self.quant.block)
        elif param is self.input_scale:
            qlinear.load_input_scale(param, source)
        else:
            _copy(param.data[offset:offset + size], source[start:start + size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return qlinear.quant_linear(self, x, self.bias)
        if self.packed is not None and self.packed.takes(x):
            return self.packed.linear(x, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_cpu_weights(model: nn.Module) -> int:
    """Every linear layer and the LM head get MKL's packed weights, where available (cpu_gemm.py)."""
    return pack_linear_weights(model, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))


def use_fast_gemm_layout(model: nn.Module) -> int:
    """On CPU, store each linear layer's weight [out, in] as the transpose of a contiguous
    [in, out] buffer; returns how many were re-laid.

    `F.linear` then reaches MKL's GEMM with a row-major B, which is faster for the 2-64-row
    products of decode, draft and verify steps (equal at 1 row and from 128; figures in
    bench/RESULTS.md). Shapes, names and the math stay the same; an embedding tied to the LM
    head reads its rows strided, which costs nothing that shows. GPUs (cuBLAS) need nothing.
    """
    num = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)) and \
                module.weight.device.type == "cpu" and getattr(module, "quant", None) is None:
            module.weight.data = module.weight.data.t().contiguous().t()
            num += 1
    return num


class QKVParallelLinear(ColumnParallelLinear):
    """Merged q|k|v projection. KV heads split over ranks; when there are fewer KV heads
    than ranks, each KV head is replicated on tp_size / num_kv_heads ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 ctx: ParallelContext, dtype: torch.dtype, quant_scheme: QuantScheme | None = None) -> None:
        tp = ctx.tp_size
        assert num_heads % tp == 0, f"num_attention_heads={num_heads} does not split over tp={tp}"
        assert num_kv_heads % tp == 0 or tp % num_kv_heads == 0, (
            f"num_key_value_heads={num_kv_heads} and tp={tp}: one must divide the other")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        # Pass per-rank sizes scaled back up so the parent splits them to exactly these.
        super().__init__(hidden_size, [self.num_heads * head_dim * tp, self.num_kv_heads * head_dim * tp,
                                       self.num_kv_heads * head_dim * tp], bias, ctx, dtype, quant_scheme)
        self.kv_replicas = max(1, tp // num_kv_heads)

    def part_start(self, part: int) -> int:
        head_group = self.ctx.tp_rank if part == 0 else self.ctx.tp_rank // self.kv_replicas
        return head_group * self.out_sizes[part]


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split over ranks. Returns this rank's partial
    sum; the caller all-reduces it. The bias is added by rank 0 only."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext,
                 dtype: torch.dtype, quant_scheme: QuantScheme | None = None) -> None:
        super().__init__()
        self.ctx = ctx
        self.in_per_rank = in_features // ctx.tp_size
        assert in_features % ctx.tp_size == 0, f"{in_features} does not split over {ctx.tp_size} ranks"
        self.quant: QuantScheme | None = None  # quantized weights and their scales (workers/quant/linear.py)
        self.weight_scale: nn.Parameter | None = None
        self.input_scale: nn.Parameter | None = None
        if quant_scheme is not None and not quant_scheme.online:
            qlinear.init_params(self, out_features, self.in_per_rank, quant_scheme)
        else:
            self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed: PackedWeight | None = None  # MKL's layout of the weight (cpu_gemm.py)

    def weight_loader(self, param: torch.Tensor, source: Any, part: int = 0) -> None:
        if param is self.bias:
            _copy(param, source[:])
            return
        start, end = shard_range(self.in_per_rank * self.ctx.tp_size, self.ctx.tp_rank, self.ctx.tp_size)
        if param is self.weight_scale:
            qlinear.load_col_scales(param, source, start, end, self.quant.block)
        elif param is self.input_scale:
            qlinear.load_input_scale(param, source)
        else:
            _copy(param, source[:, start:end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.ctx.tp_rank == 0 else None
        out = self.ctx.partial_sum_buffer(x.shape[0], self.weight.shape[0], x.dtype) if x.dim() == 2 else None
        if self.quant is not None:
            return qlinear.quant_linear(self, x, bias, out)
        if self.packed is not None and self.packed.takes(x):
            return self.packed.linear(x, bias, out)
        if out is None:
            return F.linear(x, self.weight, bias)
        # Straight into the all-reduce's shared-memory slot. The kernels F.linear runs on a
        # 2-D input (addmm with a bias, mm without), so the same bits.
        if bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(bias, x, self.weight.t(), out=out)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over ranks; each rank embeds the ids it owns, zeros elsewhere,
    and an all-reduce sums the parts."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx = ctx
        self.vocab_per_rank = math.ceil(vocab_size / ctx.tp_size)
        self.vocab_size = vocab_size
        self.start = ctx.tp_rank * self.vocab_per_rank
        self.end = min(self.start + self.vocab_per_rank, vocab_size)
        # Padded to vocab_per_rank rows so every rank's logits have the same width.
        self.weight = nn.Parameter(torch.zeros(self.vocab_per_rank, hidden_size, dtype=dtype), requires_grad=False)
        self.packed: PackedWeight | None = None  # the LM head's weight in MKL's layout (cpu_gemm.py)

    def weight_loader(self, param: torch.Tensor, source: Any, part: int = 0) -> None:
        _copy(param.data[:self.end - self.start], source[self.start:self.end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mask, input_ids - self.start, 0)
        out = F.embedding(local, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return self.ctx.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-parallel output projection: each rank scores its vocab slice, then gather."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and self.packed.takes(hidden):
            logits = self.packed.linear(hidden)  # [num_tokens, vocab_per_rank]
        else:
            logits = F.linear(hidden, self.weight)
        logits = self.ctx.all_gather_last_dim(logits)
        return logits[:, :self.vocab_size]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def weight_loader(self, param: torch.Tensor, source: Any, part: int = 0) -> None:
        _copy(param, source[:])

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given the residual stream, (norm(x + residual), x + residual).

        The sum is rounded to the dtype before the norm, as `residual + x` would be, so both
        forms give the same bits as adding first; on the GPU one kernel does both in place.
        """
        if residual is None:
            return self._norm(x)
        gpu = gpu_kernels.active_for(x)
        if gpu is not None and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous():
            gpu.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        gpu = gpu_kernels.active_for(x)
        if gpu is not None and x.dim() == 2 and x.is_contiguous():
            return gpu.rms_norm(x, self.weight, self.eps)  # one kernel instead of six
        kernels = cpu_kernels.active_for(x)
        if kernels is not None and x.dim() == 2 and x.is_contiguous():
            return kernels.rms_norm(x, self.weight, self.eps)  # one pass instead of six ops
        # Same order of operations as transformers' LlamaRMSNorm, so float32 results match.
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table for every position."""

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor, attention_scaling: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * attention_scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention_scaling).to(dtype), persistent=False)
        self.head_dim = head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
        gpu = gpu_kernels.active_for(q)
        if gpu is not None and self.cos.dtype == q.dtype:
            gpu.rope_(q, k, self.cos, self.sin, positions)  # in place, q and k in one launch
            return q, k
        kernels = cpu_kernels.active_for(q)
        if kernels is not None and self.cos.dtype == q.dtype:
            # In place, on the fused qkv output they view: the same bits as below in one pass
            # (the torch path is ~14 ops per layer).
            kernels.rope_(q, k, self.cos, self.sin, positions)
            return q, k
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def kernel_tables(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) for the Triton kernels to apply RoPE inside attention (`kernel_attention`'s
        `rope`), or None where those kernels do not run on q."""
        if gpu_kernels.active_for(q) is None or self.cos.dtype != q.dtype:
            return None
        return self.cos, self.sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the RoPE types we support."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    raise ValueError(f"rope_scaling: type {rope_type!r} is not supported (default, linear, llama3)")
