"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) holding only its pipeline stage's layers.

Per layer, with tokens flattened over the whole step ([num_tokens, hidden]):

    x -> RMSNorm -> qkv (column-parallel) -> RoPE -> paged attention -> o (row-parallel) -> all-reduce -> +x
      -> RMSNorm -> gate|up (column-parallel) -> SiLU(gate) * up -> down (row-parallel) -> all-reduce -> +x

With TP > 1 and overlap on, the per-token parts run in micro-chunks so each all-reduce
overlaps the next chunk's GEMMs (`LlamaForCausalLM._forward_overlapped`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.distributed.parallel import ParallelContext
from tandem.workers.kernels import gpu_kernels
from tandem.workers.model.attention import AttentionMetadata, KernelRope, kernel_attention, paged_attention
from tandem.workers.model.hf_config import HFModelConfig
from tandem.workers.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    rope_inv_freq,
)
from tandem.workers.model.overlap import Pending, chunk_bounds, settle, split_metadata
from tandem.workers.model.stages import stage_layers
from tandem.workers.quant.linear import quantize_module
from tandem.workers.quant.scheme import QuantScheme, ignored_modules
from tandem.workers.quant.targets import LayerQuant, layer_quant, scale_targets


class LlamaAttention(nn.Module):
    def __init__(self, cfg: HFModelConfig, ctx: ParallelContext, rope: RotaryEmbedding, window: int | None,
                 dtype: torch.dtype, quant: LayerQuant) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.attention_bias, ctx, dtype,
                                          quant("self_attn.qkv_proj"))
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM", ctx, dtype,
                                        quant("self_attn.o_proj"))
        self.rope = rope
        self.window = window
        self.head_dim = cfg.head_dim
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.scale = cfg.head_dim ** -0.5
        self.key_cache: torch.Tensor | None = None  # bound by the runner once sized
        self.value_cache: torch.Tensor | None = None
        # FP8 KV cache scales (python floats; the loader sets a checkpoint's k_scale / v_scale)
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(x), meta))  # partial sum when TP > 1

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """RoPE + paged attention over the step's merged q|k|v; [num_tokens, num_heads * head_dim]."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        tables = self.rope.kernel_tables(q) if meta.gpu is not None else None
        if tables is not None:  # RoPE and the KV write inside the attention launches
            return kernel_attention(q, k, v, self.key_cache, self.value_cache, meta, self.scale, self.window,
                                    KernelRope(*tables, positions))
        q, k = self.rope(positions, q, k)
        return paged_attention(q, k, v, self.key_cache, self.value_cache, meta, self.scale, self.window)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: HFModelConfig, ctx: ParallelContext, dtype: torch.dtype, quant: LayerQuant) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, cfg.mlp_bias,
                                                 ctx, dtype, quant("mlp.gate_up_proj"))
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, ctx, dtype,
                                           quant("mlp.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gpu = gpu_kernels.active_for(gate_up)
        if gpu is not None and gate_up.dim() == 2:
            return self.down_proj(gpu.silu_and_mul(gate_up))  # one kernel instead of three
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)  # partial sum when TP > 1


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: HFModelConfig, ctx: ParallelContext, rope: RotaryEmbedding, window: int | None,
                 dtype: torch.dtype, quant: LayerQuant) -> None:
        super().__init__()
        self.ctx = ctx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, ctx, rope, window, dtype, quant)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, ctx, dtype, quant)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next layer's norm adds
        them (one fused kernel on the GPU). `residual` None: x is the stage's input."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.ctx.all_reduce(self.self_attn(positions, h, meta))
        h, residual = self.post_attention_layernorm(h, residual)
        return self.ctx.all_reduce(self.mlp(h)), residual


# A decoder layer's checkpoint tensors (`model.layers.{i}.{suffix}.weight`, and `.bias` where
# the module has one) -> (the module in LlamaDecoderLayer, its part of a fused module).
LAYER_WEIGHTS: tuple[tuple[str, str, int], ...] = (
    ("input_layernorm", "input_layernorm", 0),
    ("post_attention_layernorm", "post_attention_layernorm", 0),
    ("self_attn.q_proj", "self_attn.qkv_proj", 0),
    ("self_attn.k_proj", "self_attn.qkv_proj", 1),
    ("self_attn.v_proj", "self_attn.qkv_proj", 2),
    ("self_attn.o_proj", "self_attn.o_proj", 0),
    ("mlp.gate_proj", "mlp.gate_up_proj", 0),
    ("mlp.up_proj", "mlp.gate_up_proj", 1),
    ("mlp.down_proj", "mlp.down_proj", 0),
)


def _set_kv_scale(attn: LlamaAttention, kind: str, _param: None, source: Any, _part: int) -> None:
    setattr(attn, kind, float(source[...].reshape(-1)[0]))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: HFModelConfig, ctx: ParallelContext, dtype: torch.dtype, max_positions: int,
                 quant_scheme: QuantScheme | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ctx = ctx
        self.quant_scheme = quant_scheme
        self.start_layer, self.end_layer = stage_layers(cfg, ctx.pp_rank, ctx.pp_size, ctx.layer_partition)
        inv_freq, scaling = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        rope = RotaryEmbedding(cfg.head_dim, max_positions, inv_freq, scaling, dtype)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, dtype) \
            if ctx.is_first_stage else None
        ignore = ignored_modules(cfg.quantization_config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, ctx, rope, cfg.layer_sliding_windows[i], dtype,
                              layer_quant(quant_scheme, ignore, f"model.layers.{i}.", LAYER_WEIGHTS))
            for i in range(self.start_layer, self.end_layer))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if ctx.is_last_stage else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx, dtype) if ctx.is_last_stage else None

    @property
    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Stage 0 takes token ids; later stages take the previous stage's hidden states."""
        x = self.embed_tokens(input_ids) if self.embed_tokens is not None else hidden
        ctx = self.ctx
        num_chunks = min(ctx.num_overlap_chunks, x.shape[0] // ctx.min_chunk_tokens) if ctx.overlaps_comm else 1
        if num_chunks > 1:
            x = self._forward_overlapped(positions, x, meta, num_chunks)
            return self.norm(x) if self.norm is not None else x
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, meta, residual)
        if residual is None:  # a stage without layers
            return self.norm(x) if self.norm is not None else x
        if self.norm is not None:
            return self.norm(x, residual)[0]
        return x + residual

    def _forward_overlapped(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                            num_chunks: int) -> torch.Tensor:
        """The same layers, with the step's tokens in micro-chunks and every row-parallel
        all-reduce started asynchronously, so it runs while the other chunk computes:

            chunk 0:  qkv attn o ─ar─────────────────┐    mlp ─ar──────────────────────┐
            chunk 1:              qkv attn o ─ar─────┼──┐      mlp ─ar───────────┐      │
                                                wait ┘  └ wait           (next layer) wait ┘ qkv ...

        Each chunk attends with its own slice of the metadata (workers/model/overlap.py); residual
        adds happen in the same order as in the serial path.
        """
        bounds = chunk_bounds(x.shape[0], num_chunks)
        metas = split_metadata(meta, bounds)
        chunks = [x[a:b] for a, b in bounds]
        pending: list[Pending | None] = [None] * num_chunks  # the previous MLP's partial sums
        for layer in self.layers:
            attn = layer.self_attn
            o_parts = []
            for c, (a, b) in enumerate(bounds):
                chunks[c] = settle(chunks[c], pending[c])
                out = attn.attend(positions[a:b], attn.qkv_proj(layer.input_layernorm(chunks[c])), metas[c])
                o_parts.append(self._reduce_async(attn.o_proj(out)))
            for c in range(num_chunks):
                chunks[c] = settle(chunks[c], o_parts[c])
                pending[c] = self._reduce_async(layer.mlp(layer.post_attention_layernorm(chunks[c])))
        out = torch.empty_like(x)
        for (a, b), chunk, last in zip(bounds, chunks, pending):
            out[a:b] = settle(chunk, last)
        return out

    def _reduce_async(self, partial: torch.Tensor) -> Pending:
        return Pending(self.ctx.all_reduce_async(partial), partial)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def kv_scale_targets(self) -> dict[str, tuple[None, Callable[..., None], int]]:
        """An FP8 KV cache's per-layer scales (`self_attn.k_scale` / `v_scale`), read from a
        checkpoint that has them: tensor name -> (None, setter, 0)."""
        targets: dict[str, tuple[None, Callable[..., None], int]] = {}
        for offset, attn in enumerate(self.attention_layers):
            prefix = f"model.layers.{self.start_layer + offset}.self_attn."
            for kind in ("k_scale", "v_scale"):
                targets[prefix + kind] = (None, partial(_set_kv_scale, attn, kind), 0)
        return targets

    def quantize_loaded(self) -> int:
        """An online scheme: quantize every decoder linear layer's loaded weight, per output row
        (a row-parallel layer's rows span every TP rank: their largest magnitudes are reduced
        over the ranks first, so the scales do not depend on the layout); returns how many."""
        scheme = self.quant_scheme
        if scheme is None or not scheme.online:
            return 0
        num = 0
        for layer in self.layers:
            for path in dict.fromkeys(path for _, path, _ in LAYER_WEIGHTS):
                module = layer.get_submodule(path)
                if not hasattr(module, "quant"):  # a norm
                    continue
                row_amax = None
                if isinstance(module, RowParallelLinear):
                    row_amax = self.ctx.all_reduce_max(module.weight.data.float().abs().amax(dim=1))
                quantize_module(module, scheme, row_amax)
                num += 1
        return num

    def weight_targets(self) -> dict[str, tuple[torch.Tensor, Callable[..., None], int]]:
        """Checkpoint tensor name -> (parameter, loader, part) for this stage and rank only."""
        targets: dict[str, tuple[torch.Tensor, Callable[..., None], int]] = {}

        def add(name: str, module: Any, param: torch.Tensor, part: int = 0) -> None:
            targets[name] = (param, module.weight_loader, part)

        if self.embed_tokens is not None:
            add("model.embed_tokens.weight", self.embed_tokens, self.embed_tokens.weight)
        for offset, layer in enumerate(self.layers):
            prefix = f"model.layers.{self.start_layer + offset}."
            for suffix, path, part in LAYER_WEIGHTS:
                module = layer.get_submodule(path)
                if getattr(module, "quant", None) is not None:
                    targets.update(scale_targets(module, prefix + suffix, part))
                elif module.weight is not None:
                    add(f"{prefix}{suffix}.weight", module, module.weight, part)
                if getattr(module, "bias", None) is not None:
                    add(f"{prefix}{suffix}.bias", module, module.bias, part)
        if self.norm is not None:
            add("model.norm.weight", self.norm, self.norm.weight)
            head_name = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
            if head_name in targets:  # tied on a single stage: one checkpoint tensor, two params
                targets["lm_head.weight@tied"] = (self.lm_head.weight, self.lm_head.weight_loader, 0)
            else:
                add(head_name, self.lm_head, self.lm_head.weight)
        return targets
