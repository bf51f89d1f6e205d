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
    def from_hf_config(cfg: HFModelConfig, itemsize: int) -> ModelCost:
        """From the checkpoint's config alone (any TP x PP: the whole model's figures)."""
        hidden, head_dim = cfg.hidden_size, cfg.head_dim
        q_out, kv_out = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
        per_layer = (hidden * (q_out + 2 * kv_out) + q_out * hidden  # q, k, v, o
                     + 3 * hidden * cfg.intermediate_size + 2 * hidden)  # gate, up, down; two norms
        if cfg.attention_bias:
            per_layer += q_out + 2 * kv_out
        return ModelCost(num_layers=cfg.num_hidden_layers, hidden_size=hidden, num_kv_heads=cfg.num_key_value_heads,
                         head_dim=head_dim, non_embedding_params=cfg.num_hidden_layers * per_layer + hidden,
                         lm_head_params=cfg.vocab_size * hidden, itemsize=itemsize)

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
