"""What a model's forward pass costs in FLOPs and bytes: the numerators of MFU and MBU.

FLOPs (model FLOPs, as in PaLM's MFU: what the model needs, not what an implementation does):

    per processed token (prompt or output), at context length c (keys it attends to):
        2 * non_embedding_params                        # every linear layer, multiply + add
      + 2 * 2 * num_layers * c * hidden                 # q.k^T and attn.v
    per sampled token (one per output token):
      + 2 * lm_head_params                              # the logits row

The lm_head is counted once per *sampled* token, not once per prompt token: no engine (nor
`transformers.generate`) computes logits for prompt positions it does not sample from, and
counting them would inflate MFU by about a quarter on the offline workload. The input
embedding is a lookup and costs no FLOPs. A prompt token at position i attends to c = i + 1
keys; an output token at position p likewise.

Bytes read by one decode step at batch B (the MBU numerator):

    weight_bytes = (non_embedding_params + lm_head_params) * itemsize
    kv_bytes     = B * c * 2 * num_layers * num_kv_heads * head_dim * itemsize

The input embedding table is left out of the weights: a decode step reads B rows of it, not
the table (with tied embeddings the lm_head *is* that table and is counted once, as lm_head).
It is in `memory_bytes`, what the weights take in memory. Quantized linear weights (FP8, INT8)
take `weight_itemsize` bytes each, the embedding, lm_head, norms and biases stay in the model's
dtype (their scales, one float per output channel or tensor, are left out: under 0.1%); an
FP8 KV cache takes `kv_itemsize` bytes per element.

`shard` is one rank's part of a TP x PP layout, for `tandem plan` (workers/model/plan.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from tandem.workers.model.hf_config import HFModelConfig


@dataclass(frozen=True)
class ModelCost:
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    non_embedding_params: int  # everything but the input embedding and the lm_head
    lm_head_params: int
    itemsize: int  # bytes per weight / KV element
    # Of non_embedding_params, the linear layers' weights: what weight quantization shrinks.
    linear_params: int = 0
    # The input embedding where it is a tensor of its own: in memory, but a decode step reads
    # only its B rows (see the module docstring).
    embedding_params: int = 0
    weight_itemsize: int | None = None  # bytes per linear weight (1: FP8 / INT8); None: itemsize
    kv_itemsize: int | None = None  # bytes per KV element (1: an FP8 cache); None: itemsize

    @staticmethod
    def from_tandem_model(model: nn.Module, itemsize: int) -> ModelCost:
        """From a tandem `LlamaForCausalLM` (TP = PP = 1)."""
        embed = {id(p) for m in (model.embed_tokens, model.lm_head) for p in m.parameters()}
        non_embedding = sum(p.numel() for p in model.parameters() if id(p) not in embed)
        attn = model.attention_layers[0]
        return ModelCost(num_layers=len(model.layers), hidden_size=model.cfg.hidden_size,
                         num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                         non_embedding_params=non_embedding, lm_head_params=model.lm_head.weight.numel(),
                         itemsize=itemsize)

    @staticmethod
    def from_hf_config(cfg: HFModelConfig, itemsize: int, weight_itemsize: int | None = None,
                       kv_itemsize: int | None = None) -> ModelCost:
        """From the checkpoint's config alone: the whole model as its checkpoint holds it (any TP x PP)."""
        whole = ModelCost.shard(cfg, itemsize, weight_itemsize, kv_itemsize)
        # A tied checkpoint holds one table for both (the engine two: see `shard`).
        return replace(whole, embedding_params=0) if cfg.tie_word_embeddings else whole

    @staticmethod
    def shard(cfg: HFModelConfig, itemsize: int, weight_itemsize: int | None = None, kv_itemsize: int | None = None,
              tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> ModelCost:
        """One rank of stage `pp_rank`, as tandem lays it out (workers/model/layers.py, llama.py): 1/tp
        of each layer's heads and intermediate columns (a KV head replicated where tp exceeds their
        number), norms and row-parallel biases whole, ceil(vocab / tp) rows of the embedding (first
        stage) and of the lm_head (last stage; a tied checkpoint's table is loaded into both).
        `hidden_size` is the attention's width on the rank (hidden / tp), what its FLOPs count."""
        from tandem.workers.model.stages import stage_layers

        hidden, head_dim = cfg.hidden_size, cfg.head_dim
        q_out = cfg.num_attention_heads // tp_size * head_dim
        num_kv_heads = max(1, cfg.num_key_value_heads // tp_size)
        kv_out = num_kv_heads * head_dim
        inter = math.ceil(cfg.intermediate_size / tp_size)
        linear = hidden * (q_out + 2 * kv_out) + q_out * hidden + 3 * hidden * inter  # q, k, v, o; gate, up, down
        other = 2 * hidden  # two norms
        if cfg.attention_bias:
            other += q_out + 2 * kv_out + (hidden if cfg.architecture != "Qwen2ForCausalLM" else 0)  # o_proj's
        if cfg.mlp_bias:
            other += 2 * inter + hidden
        start, end = stage_layers(cfg, pp_rank, pp_size)
        num_layers = end - start
        is_first, is_last = pp_rank == 0, pp_rank == pp_size - 1
        vocab_rows = math.ceil(cfg.vocab_size / tp_size) * hidden
        return ModelCost(num_layers=num_layers, hidden_size=hidden // tp_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, non_embedding_params=num_layers * (linear + other) + is_last * hidden,
                         lm_head_params=is_last * vocab_rows, itemsize=itemsize, linear_params=num_layers * linear,
                         embedding_params=is_first * vocab_rows, weight_itemsize=weight_itemsize,
                         kv_itemsize=kv_itemsize)

    # ---- FLOPs ---------------------------------------------------------------------------------
    def attention_flops(self, context_len: int) -> int:
        return 2 * 2 * self.num_layers * context_len * self.hidden_size

    def request_flops(self, prompt_len: int, output_len: int, lm_head_every_token: bool = False) -> int:
        """Model FLOPs to prefill `prompt_len` tokens and decode `output_len` tokens.

        The first output token comes from the prefill pass; the other output_len - 1 are fed
        back, so output_len - 1 more tokens are processed, at positions prompt_len .. +output_len-2.
        `lm_head_every_token` charges logits for every processed token (the literal reading).
        """
        num_processed = prompt_len + output_len - 1
        # sum of context lengths 1 + 2 + ... + num_processed
        sum_ctx = num_processed * (num_processed + 1) // 2
        num_logits = num_processed if lm_head_every_token else output_len
        return (2 * self.non_embedding_params * num_processed
                + 2 * 2 * self.num_layers * self.hidden_size * sum_ctx
                + 2 * self.lm_head_params * num_logits)

    def step_flops(self, num_tokens: int, num_attention_pairs: int, num_logit_rows: int) -> int:
        """Any step: `num_tokens` processed, `num_attention_pairs` (query, key) pairs attended,
        `num_logit_rows` rows through the lm_head."""
        return (2 * self.non_embedding_params * num_tokens + 2 * 2 * self.num_layers * self.hidden_size
                * num_attention_pairs + 2 * self.lm_head_params * num_logit_rows)

    def decode_step_flops(self, batch: int, context_len: int) -> int:
        """One decode step: `batch` tokens, each attending to `context_len` keys."""
        return batch * (2 * (self.non_embedding_params + self.lm_head_params)
                        + self.attention_flops(context_len))

    # ---- bytes ---------------------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return self.non_embedding_params + self.lm_head_params + self.embedding_params

    @property
    def weight_bytes(self) -> int:
        """What a decode step reads of the weights (all but the input embedding)."""
        linear_itemsize = self.weight_itemsize or self.itemsize
        return ((self.non_embedding_params - self.linear_params + self.lm_head_params) * self.itemsize
                + self.linear_params * linear_itemsize)

    @property
    def memory_bytes(self) -> int:
        """What the weights take in memory: those a step reads, and the input embedding."""
        return self.weight_bytes + self.embedding_params * self.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * (self.kv_itemsize or self.itemsize)

    def decode_step_bytes(self, batch: int, context_len: int) -> int:
        return self.weight_bytes + batch * context_len * self.kv_bytes_per_token

    def step_bytes(self, num_context_tokens: int, num_passes: int = 1) -> int:
        """Any step: the weights once a forward pass, plus the KV of every token its requests
        attend to (over all its passes)."""
        return num_passes * self.weight_bytes + num_context_tokens * self.kv_bytes_per_token

    def roofline_crossover_batch(self, context_len: int, peak_flops: float, peak_bytes_per_s: float,
                                 max_batch: int = 4096) -> float:
        """Smallest batch whose decode step is compute-bound on a roofline (intensity >= ridge)."""
        ridge = peak_flops / peak_bytes_per_s  # FLOP per byte
        for batch in range(1, max_batch + 1):
            if self.decode_step_flops(batch, context_len) / self.decode_step_bytes(batch, context_len) >= ridge:
                return float(batch)
        return float("inf")
