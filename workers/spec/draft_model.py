"""The draft model: a small model with its own paged KV cache guesses k tokens.

The draft keeps, per target request, the tokens whose KV it has computed. Each
`propose` call first syncs with the target: the longest common prefix of its tokens
and the request's (prompt + accepted outputs) stays computed, the rest is
recomputed in one catch-up pass whose last position yields draft token 1; then
k - 1 single-token decode steps yield the rest. Drafts are greedy (point masses),
which the rejection sampler verifies exactly.

It drives an executor through the same step messages as a replica group: the model
in this process at TP=1, or `speculative_draft_tensor_parallel_size` Worker actors
(a RayExecutor) above that. The same code runs in the engine's process or inside a
DraftWorker actor (draft_proposer.py), which several groups may share: each group's
requests live under the group's namespace, and one group's batch never drops another's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.cluster.placement import DevicePin
from tandem.workers.config import EngineConfig
from tandem.workers.core.block_pool import BlockPool, LocalCapacity
from tandem.workers.core.request import SamplingParams
from tandem.workers.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tandem.workers.model.hf_config import HFModelConfig

logger = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)
# A group that has not asked for drafts this long has its sequences dropped (their KV
# freed): it went away without detaching, or stopped drafting (a large batch). Dropping
# only costs a recompute if it comes back.
IDLE_NAMESPACE_S = 30.0


@dataclass(frozen=True)
class DraftSettings:
    """What a draft is built from; groups sharing one draft must agree on it."""

    model: str
    k: int
    block_size: int
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    device: str = "auto"
    max_model_len: int | None = None

    def clash(self, other: DraftSettings) -> list[str]:
        """The fields that must match for a group to use a draft built with `other`."""
        return [name for name in ("model", "k", "block_size", "dtype", "tensor_parallel_size")
                if getattr(self, name) != getattr(other, name)]


@dataclass
class _DraftSeq:
    namespace: str
    tokens: list[int] = field(default_factory=list)  # tokens the draft knows (KV for [:num_computed])
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)


class DraftModelCore:
    """Proposes k greedy draft tokens for batches of token sequences, keyed by namespace + id."""

    def __init__(self, settings: DraftSettings, pins: list[DevicePin] | None = None, placement: str = "") -> None:
        from tandem.workers.executor.uniproc import UniProcExecutor

        self.settings = settings
        self.k = settings.k
        self.placement = placement
        self.hf_config = HFModelConfig.from_dir(settings.model)
        self.config = EngineConfig.from_options(
            model=settings.model, dtype=settings.dtype, block_size=settings.block_size,
            num_kv_blocks=settings.num_kv_blocks, kv_cache_memory=settings.kv_cache_memory,
            num_lookahead_slots=settings.k, max_model_len=settings.max_model_len, device=settings.device,
            tensor_parallel_size=settings.tensor_parallel_size,
            max_num_seqs=256, max_num_batched_tokens=max(8192, 256 * (1 + settings.k)))
        if settings.tensor_parallel_size > 1:
            from tandem.workers.executor.ray_executor import RayExecutor

            self.executor: Any = RayExecutor(self.config, self.hf_config, settings.model, pins=pins)
        else:
            self.executor = UniProcExecutor(self.config, self.hf_config, settings.model, show_progress=False)
        num_blocks = self.executor.num_kv_blocks
        self.pool = BlockPool(LocalCapacity(num_blocks), num_blocks)
        self.block_size = settings.block_size
        self.seqs: dict[str, _DraftSeq] = {}
        self.attached: set[str] = set()
        self.last_seen: dict[str, float] = {}
        self.num_batches: dict[str, int] = {}  # propose calls per namespace
        self._step_id = 0
        self._sent: set[str] = set()

    # ---- groups sharing this draft ------------------------------------------------------------------
    def attach(self, namespace: str) -> int:
        self.attached.add(namespace)
        self.last_seen[namespace] = time.monotonic()
        return len(self.attached)

    def detach(self, namespace: str) -> int:
        """Forget a group; returns how many groups are left (0: whoever holds it may end it)."""
        self.attached.discard(namespace)
        self.last_seen.pop(namespace, None)
        for seq_id in [s for s, seq in self.seqs.items() if seq.namespace == namespace]:
            self._drop(seq_id)
        return len(self.attached)

    # ---- proposing -----------------------------------------------------------------------------------
    def propose(self, batch: dict[str, list[int]], namespace: str = "") -> dict[str, list[int]]:
        """batch: id -> the request's tokens so far (ids start with `namespace`). Returns
        id -> up to k draft tokens. The namespace's sequences missing from the batch are done."""
        now = time.monotonic()
        self.last_seen[namespace] = now
        self.num_batches[namespace] = self.num_batches.get(namespace, 0) + 1
        for seq_id, seq in list(self.seqs.items()):
            idle = now - self.last_seen.get(seq.namespace, 0.0) > IDLE_NAMESPACE_S
            if (seq.namespace == namespace and seq_id not in batch) or idle:
                self._drop(seq_id)
        ready = [seq_id for seq_id, tokens in batch.items() if self._sync(seq_id, tokens, namespace)]
        if not ready or self.k == 0:
            return {seq_id: [] for seq_id in batch}
        drafts: dict[str, list[int]] = {seq_id: [] for seq_id in batch}
        out = self._catch_up_step(ready)
        for step in range(self.k):
            result = self.executor.execute(out)
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

    def _sync(self, seq_id: str, tokens: list[int], namespace: str) -> bool:
        seq = self.seqs.setdefault(seq_id, _DraftSeq(namespace))
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

    def describe(self) -> dict[str, Any]:
        """Where this draft runs (node and GPUs per rank when on Ray), for logs and tests."""
        import ray

        info: dict[str, Any] = {"placement": self.placement, "settings": self.settings,
                                "attached": sorted(self.attached), "num_seqs": len(self.seqs),
                                "num_batches": dict(self.num_batches),
                                "num_free_blocks": self.pool.num_free_blocks, "num_blocks": self.pool.num_blocks}
        workers = getattr(self.executor, "worker_info", None)
        if workers is not None:  # TP > 1: the Worker actors hold the model
            return info | {"ranks": [{k: w[k] for k in ("node_id", "gpu_ids", "device")} for w in workers]}
        here = {"node_id": None, "gpu_ids": [], "device": str(self.executor.runner.device)}
        if ray.is_initialized():
            here |= {"node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": ray.get_gpu_ids()}
        return info | {"ranks": [here]}

    def worker_handles(self) -> list[Any]:
        """The Worker actors of a TP > 1 draft (tests look inside them)."""
        return list(getattr(self.executor, "workers", []))

    def shutdown(self) -> None:
        self.executor.shutdown()
