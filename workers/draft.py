"""Draft-model proposer: a small model with its own paged KV cache guesses k tokens.

The draft keeps, per target request, the tokens whose KV it has computed. Each
`propose` call first syncs with the target: the longest common prefix of its tokens
and the request's (prompt + accepted outputs) stays computed, the rest is
recomputed in one catch-up pass whose last position yields draft token 1; then
k - 1 single-token decode steps yield the rest. Drafts are greedy (point masses),
which the rejection sampler verifies exactly.

It drives a `ModelRunner` through the same step messages as a replica group, so
the same code runs in-process or inside a `DraftWorker` actor on a spare GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tandem.cluster.config import EngineConfig
from tandem.workers.block_pool import BlockPool, LocalCapacity
from tandem.workers.model_runner import ModelRunner
from tandem.workers.models.hf_config import HFModelConfig
from tandem.workers.parallel import ParallelContext
from tandem.workers.request import Request, SamplingParams
from tandem.workers.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass
class _DraftSeq:
    tokens: list[int] = field(default_factory=list)  # tokens the draft knows (KV for [:num_computed])
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)


class DraftModelCore:
    """Proposes k greedy draft tokens for a batch of token sequences, keyed by an id."""

    def __init__(self, draft_dir: str, k: int, *, block_size: int = 16, num_kv_blocks: int | None = None,
                 kv_cache_memory: int | None = None, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None) -> None:
        from tandem.workers.executor import pick_device

        self.k = k
        self.hf_config = HFModelConfig.from_dir(draft_dir)
        self.config = EngineConfig.from_options(
            model=draft_dir, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory, num_lookahead_slots=k, max_model_len=max_model_len,
            max_num_seqs=256, max_num_batched_tokens=max(8192, 256 * (1 + k)))
        self.runner = ModelRunner(self.config, self.hf_config, draft_dir, ParallelContext(), pick_device(device))
        self.runner.load_model(show_progress=False)
        num_blocks = self.runner.num_blocks_fit()
        self.runner.init_kv_cache(num_blocks)
        self.pool = BlockPool(LocalCapacity(num_blocks), num_blocks)
        self.block_size = block_size
        self.seqs: dict[str, _DraftSeq] = {}
        self._step_id = 0
        self._sent: set[str] = set()

    def propose(self, batch: dict[str, list[int]]) -> dict[str, list[int]]:
        """batch: id -> the request's tokens so far. Returns id -> up to k draft tokens."""
        for gone in set(self.seqs) - set(batch):  # finished or no longer decoding
            self._drop(gone)
        ready = [seq_id for seq_id, tokens in batch.items() if self._sync(seq_id, tokens)]
        if not ready or self.k == 0:
            return {seq_id: [] for seq_id in batch}
        drafts: dict[str, list[int]] = {seq_id: [] for seq_id in batch}
        out = self._catch_up_step(ready)
        for step in range(self.k):
            result = self.runner.execute(out)
            for seq_id, tokens in zip(result.req_ids, result.sampled_token_ids):
                drafts[seq_id].extend(tokens)
            if step == self.k - 1:
                break
            out = self._decode_step(ready, drafts)
        for seq_id in ready:
            seq = self.seqs[seq_id]
            seq.num_computed = len(seq.tokens) + self.k - 1
            seq.tokens = seq.tokens + drafts[seq_id][:-1]
        return drafts

    def _sync(self, seq_id: str, tokens: list[int]) -> bool:
        seq = self.seqs.setdefault(seq_id, _DraftSeq())
        common = 0
        limit = min(len(seq.tokens), len(tokens), seq.num_computed)
        while common < limit and seq.tokens[common] == tokens[common]:
            common += 1
        # Recompute at least the last token: its logits give draft token 1.
        seq.num_computed = min(common, len(tokens) - 1)
        seq.tokens = list(tokens)
        need = -(-(len(tokens) + self.k) // self.block_size) - len(seq.block_ids)
        if need > 0:
            if need > self.pool.num_free_blocks:
                logger.debug("draft KV full; no drafts for %s this step", seq_id)
                self._drop(seq_id)
                return False
            seq.block_ids.extend(self.pool.allocate(need))
        return True

    def _catch_up_step(self, ready: list[str]) -> SchedulerOutput:
        out = SchedulerOutput(step_id=self._next_step(), finished_req_ids=set(self._sent))
        self._sent = set(ready)
        for seq_id in ready:
            seq = self.seqs[seq_id]
            out.new_requests.append(NewRequestData(seq_id, list(seq.tokens), [], _GREEDY, list(seq.block_ids),
                                                   seq.num_computed))
            out.num_scheduled_tokens[seq_id] = len(seq.tokens) - seq.num_computed
        return out

    def _decode_step(self, ready: list[str], drafts: dict[str, list[int]]) -> SchedulerOutput:
        out = SchedulerOutput(step_id=self._next_step())
        for seq_id in ready:
            seq = self.seqs[seq_id]
            done = len(drafts[seq_id])
            out.cached_requests.append(CachedRequestData(seq_id, drafts[seq_id][-1:], [],
                                                         len(seq.tokens) + done - 1, len(seq.block_ids)))
            out.num_scheduled_tokens[seq_id] = 1
        return out

    def _next_step(self) -> int:
        self._step_id += 1
        return self._step_id

    def _drop(self, seq_id: str) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None and seq.block_ids:
            self.pool.free(seq.block_ids[::-1])

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def describe(self) -> dict:
        """Where this draft runs (node and GPUs when it is a Ray actor), for logs and tests."""
        import ray

        if not ray.is_initialized():
            return {"node_id": None, "gpu_ids": [], "device": str(self.runner.device)}
        return {"node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": ray.get_gpu_ids(),
                "device": str(self.runner.device)}


class DraftModelProposer:
    """Engine-side proposer over a DraftModelCore in this process or in a DraftWorker actor."""

    def __init__(self, core: "DraftModelCore | object", namespace: str = "") -> None:
        self.core = core
        self.namespace = namespace  # one draft actor may serve several groups

    def propose(self, requests: list[Request]) -> None:
        batch = {self.namespace + r.request_id: r.all_token_ids for r in requests}
        if hasattr(self.core, "propose") and not hasattr(self.core.propose, "remote"):
            drafts = self.core.propose(batch)
        else:
            import ray

            drafts = ray.get(self.core.propose.remote(batch))  # engine thread: not async code
        for req in requests:
            req.spec_token_ids = drafts.get(self.namespace + req.request_id, [])
