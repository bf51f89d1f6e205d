"""The engine's side of a draft model: where the draft goes, and asking it for drafts.

Where (`plan_draft`):
  - on spare GPUs (ones no placement group or actor holds) when enough sit on one node
    for the draft's tensor-parallel size;
  - else sharing the group's first devices, without reserving them again (on a CPU
    cluster: the group's first node). The choice is logged.

A draft is a DraftWorker: a `DraftModelCore` in a Ray actor (its TP ranks, when more
than one, are Worker actors it drives). An engine outside Ray with a TP=1 draft keeps the
draft in its own process instead. With `speculative_draft_actor_name` set, engines share
one draft: the first creates the named actor, the others attach to it, and each group's
requests live under a namespace of its own. The actor is fate-shared with the process
that created it; when it dies (that group went away) the next group to ask starts it
again, without drafts until it is up, and the last group to detach ends it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.cluster.placement import DevicePin
from tandem.workers.config import EngineConfig, draft_dtype
from tandem.workers.core.request import Request
from tandem.workers.spec.draft_model import DraftModelCore, DraftSettings

logger = logging.getLogger(__name__)
DRAFT_NAMESPACE = "tandem"  # the Ray namespace of shared draft actors
DRAFT_START_TIMEOUT_S = 300.0  # loading included; past it the group fails to start, loudly


def draft_actor_name(app_name: str) -> str:
    """The draft actor a Serve application's groups share."""
    return f"tandem-draft-{app_name}"


def draft_settings(config: EngineConfig) -> DraftSettings:
    spec, cache = config.speculative, config.cache
    return DraftSettings(model=spec.speculative_model, k=spec.num_speculative_tokens, block_size=cache.block_size,
                         dtype=draft_dtype(config), tensor_parallel_size=spec.speculative_draft_tensor_parallel_size,
                         kv_cache_memory=cache.kv_cache_memory, device=config.model.device,
                         max_model_len=config.model.max_model_len)


@dataclass(frozen=True)
class DraftPlacement:
    actor_options: dict[str, Any]  # the DraftWorker actor's Ray options
    pins: list[DevicePin] | None  # TP > 1 sharing the group's devices: where each rank goes
    where: str  # for the log
    spare: bool = False


def plan_draft(tp: int, group: list[DevicePin], spare: dict[str, int]) -> DraftPlacement:
    """Where a draft of `tp` ranks goes: `spare` (node -> free GPUs) first, else the group's devices."""
    fits = {node: n for node, n in spare.items() if n >= tp}
    if fits:
        node = max(fits, key=fits.get)
        on_node = DevicePin(node).actor_options()  # pinned to the node, nothing reserved
        if tp == 1:
            return DraftPlacement(on_node | {"num_gpus": 1}, None, f"a spare GPU on node {node}", spare=True)
        # The actor only coordinates; its Worker actors reserve the GPUs (a placement group).
        return DraftPlacement(on_node, None, f"{tp} spare GPUs on node {node}", spare=True)
    if not group:
        raise ValueError("speculative draft: no spare GPU and no group device to share")
    on_gpu = any(pin.gpu_ids for pin in group)
    if not on_gpu:  # CPUs: the group's first node's cores
        pins = [DevicePin(group[0].node_id)] * tp
        where = "the group's first device (no spare GPU in the cluster)"
    elif tp <= len(group):
        pins = group[:tp]
        where = ("the group's first device (no spare GPU in the cluster)" if tp == 1 else
                 f"the group's first {tp} devices (no {tp} spare GPUs on one node)")
    else:
        raise ValueError(f"speculative_draft_tensor_parallel_size={tp}: no node has {tp} spare GPUs "
                         f"(spare: {spare or 'none'}) and the group has only {len(group)} to share")
    if tp == 1:
        return DraftPlacement(pins[0].actor_options(), None, where)
    return DraftPlacement(DevicePin(pins[0].node_id).actor_options(), pins, where)


class DraftModelProposer:
    """Asks a draft (in this process, or a DraftWorker actor) for every step's drafts."""

    def __init__(self, core: Any, namespace: str = "", *, restart: Callable[[], Any] | None = None,
                 placement: str = "", timeout_s: float = 60.0) -> None:
        self.core = core
        self.namespace = namespace
        self.placement = placement
        self.timeout_s = timeout_s  # a draft that hangs this long is replaced
        self._restart = restart
        self._starting: Any = None  # an attach call on a restarted actor, until it answers
        self.local = isinstance(core, DraftModelCore)
        self.num_restarts = 0

    def propose(self, requests: list[Request]) -> None:
        batch = {self.namespace + r.request_id: r.all_token_ids for r in requests}
        drafts = self._ask(batch)
        for req in requests:
            req.spec_token_ids = drafts.get(self.namespace + req.request_id, [])

    def _ask(self, batch: dict[str, list[int]]) -> dict[str, list[int]]:
        """The drafts, or none: a draft that fails never fails the target's requests (their
        output does not depend on drafts), it is replaced or dropped instead."""
        if self.core is None:
            return {}
        if self.local:
            try:
                return self.core.propose(batch, self.namespace)
            except Exception:  # noqa: BLE001 - serve on without drafts
                logger.exception("speculative draft failed: no more drafts")
                self.core = None
                return {}
        import ray

        if self._starting is not None:
            ready, _ = ray.wait([self._starting], timeout=0)
            if not ready:
                return {}  # the draft is still loading: verify without drafts meanwhile
            self._starting = None
        try:
            # The engine's own thread (not async code): it waits for the drafts it verifies.
            return ray.get(self.core.propose.remote(batch, self.namespace), timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - died, hung, or its own workers failed
            self._start_again(exc)
            return {}

    def _start_again(self, exc: BaseException) -> None:
        import ray
        from ray.exceptions import RayActorError

        self.num_restarts += 1
        if not isinstance(exc, RayActorError):  # alive but broken (a TP rank died) or hung: end it
            try:
                ray.kill(self.core)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._restart is None:
            logger.error("speculative draft failed (%s): no more drafts", exc)
            self.core = None
            return
        logger.warning("speculative draft failed (%s): starting it again; no drafts until it is up", exc)
        try:
            self.core = self._restart()
            self._starting = self.core.attach.remote(self.namespace)
        except Exception as again:  # noqa: BLE001 - serve on without drafts
            logger.error("speculative draft could not be started again (%s): no more drafts", again)
            self.core = None

    def shutdown(self) -> None:
        """Detach; the last group to leave ends the draft."""
        if self.local:
            self.core.shutdown()
            return
        if self.core is None:
            return
        import ray

        try:
            left = ray.get(self.core.detach.remote(self.namespace), timeout=10)
            if left == 0:
                ray.get(self.core.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - already gone
            return
        if left == 0:
            ray.kill(self.core)


@dataclass(frozen=True)
class _DraftStarter:
    """Creates (or, shared by name, finds) the DraftWorker actor for one group."""

    config: EngineConfig
    settings: DraftSettings
    group: list[DevicePin]

    def __call__(self) -> Any:
        import ray

        from tandem.cluster.placement import spare_gpus

        on_gpu = any(pin.gpu_ids for pin in self.group)
        placement = plan_draft(self.settings.tensor_parallel_size, self.group, spare_gpus() if on_gpu else {})
        options = dict(placement.actor_options)
        name = self.config.speculative.speculative_draft_actor_name
        if name:
            options |= dict(name=name, namespace=DRAFT_NAMESPACE, get_if_exists=True)
        return ray.remote(DraftModelCore).options(**options).remote(self.settings, placement.pins, placement.where)


def start_draft(config: EngineConfig, executor: Any) -> DraftModelProposer:
    """The draft the options ask for, placed (or found, when shared) and attached."""
    settings = draft_settings(config)
    pins = executor.device_pins()
    name = config.speculative.speculative_draft_actor_name
    if not pins and name is None and settings.tensor_parallel_size == 1:
        return DraftModelProposer(DraftModelCore(settings, placement="the engine's process"),
                                  placement="the engine's process")
    import ray

    from tandem.cluster.placement import ensure_ray

    if not pins:
        ensure_ray(config.parallel.address)
        pins = executor.device_pins()
    starter = _DraftStarter(config, settings, pins)
    handle = starter()
    try:
        info = ray.get(handle.describe.remote(), timeout=DRAFT_START_TIMEOUT_S)  # waits for the draft to load
    except ray.exceptions.GetTimeoutError:
        ray.kill(handle)
        raise RuntimeError(f"speculative draft {settings.model} did not start within {DRAFT_START_TIMEOUT_S:g} s "
                           "(its devices were probably taken after placement was planned)") from None
    clash = settings.clash(info["settings"])
    if clash:
        raise ValueError(f"speculative_draft_actor_name={name!r}: that draft was built with other "
                         f"{', '.join(clash)} ({info['settings']}) than this group asks for ({settings})")
    namespace = f"{uuid.uuid4().hex[:12]}/"
    ray.get(handle.attach.remote(namespace))
    where = info["placement"] if not name else f"shared draft actor {name!r} on {info['placement']}"
    logger.info("speculative draft model %s placed on %s", settings.model, where)
    return DraftModelProposer(handle, namespace, restart=starter, placement=where)
