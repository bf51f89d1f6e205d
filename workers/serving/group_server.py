"""GroupServer: the Serve deployment whose one replica is one replica group.

A thin shim over `AsyncEngine`: a `GroupRequest` in, `GroupDelta`s out (messages.py;
tensors never leave the group). A streamed request's deltas, made at its channel's pace (the
ingress's budget shared by the channel's streams), go into its ingress's outbox (outbox.py)
and leave on that ingress's channel, one batch per flush for all its streams:
a connection to the group's channel socket (channel_server.py; `channel_transport`
"socket", the default) or a `channel` call ("serve"). A request answered whole gets its one
delta as the call's answer. An ingress may also send streamed requests on its socket
channel instead of a call each (`submit`, `abort`, `lost`: the channel's `ChannelRequests`);
its `hold` call keeps Serve's graceful stop of this group waiting for them.

With tensor or pipeline parallelism the replica runs in bundle 0 of its own placement
group (set through the deployment's placement-group options in router/app.py) and the
engine starts its workers in the rest.

When a worker of a TP or PP group dies, the group starts new workers in its placement
group and serves again without Serve replacing the replica (workers/serving/group_healer.py).

With prefix caching on, the group registers with the application's cluster KV allocator
(cluster/kv_allocator.py; created by the first group to start) and publishes its block
events and usage after every step through an `AllocatorClient`, which batches them on a
thread of its own: serving never waits on the allocator, and carries on if it dies.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ray import serve

from tandem.cluster.allocator_client import AllocatorClient, GroupIdentity
from tandem.cluster.kv_allocator import get_or_create_allocator
from tandem.workers.config import EngineConfig
from tandem.workers.core.output_pace import OutputPace
from tandem.workers.core.request import RequestOutput
from tandem.workers.engine.engine_dead import EngineDeadError
from tandem.workers.serving import tracer
from tandem.workers.serving.channel_server import ChannelServer
from tandem.workers.serving.group_healer import GroupHealer, HealPolicy
from tandem.workers.serving.group_metrics import start_group_metrics
from tandem.workers.serving.kv_fetch import KVFetcher
from tandem.workers.serving.messages import (
    GROUP_STATS_KEY,
    Accepted,
    ChannelOpen,
    DeltaBatch,
    ErrorKind,
    GroupDelta,
    GroupRequest,
    GroupStats,
    PrefixExport,
    PrefixExportRequest,
    RoutingStats,
    StatsRequest,
)
from tandem.workers.serving.outbox import Outboxes

if TYPE_CHECKING:  # the engine (and torch) load in the group's replica, not where the app is built
    from tandem.workers.engine.async_engine import Deliver
    from tandem.workers.engine.group_engine import GroupEngine

logger = logging.getLogger(__name__)
# A step running this long has hung (a stalled device, a stopped worker: nothing fails, so
# nothing else would notice): the health check fails and Serve replaces the group. Far beyond
# any step's time (the slowest, prefill chunks on a CPU, take seconds).
DEFAULT_STEP_TIMEOUT_S = 30.0


@serve.deployment(name="GroupServer")
class GroupServer:
    def __init__(self, config: EngineConfig, group_options: dict[str, Any] | None = None) -> None:
        # torch and the model: only in the group, never where the application is built
        from tandem.workers.engine.async_engine import AsyncEngine
        from tandem.workers.engine.builder import build_engine, rebuild_engine
        from tandem.workers.spec.draft_proposer import draft_actor_name

        # Two threads share this process's GIL: the engine's (model steps: hundreds of short
        # Python stretches between torch ops) and Serve's event loop (every streamed delta).
        # Under load, CPython's default switch interval leaves the engine thread waiting that
        # long for the GIL again and again; a tenth of it keeps the model stepping (figures in
        # bench/RESULTS.md).
        sys.setswitchinterval(0.0005)
        group_options = group_options or {}
        context = serve.get_replica_context()
        spec = config.speculative
        if (spec.enabled and spec.speculative_model != "ngram" and spec.speculative_draft_actor_name is None
                and group_options.get("share_draft", True)):
            # One draft actor for the application's groups (workers/spec/draft_proposer.py).
            config = replace(config, speculative=replace(spec, speculative_draft_actor_name=draft_actor_name(
                context.app_name)))
        self.config = config
        # The host tier waits for its lease from the allocator (below).
        engine = build_engine(replace(config, cache=replace(config.cache, host_kv_cache_memory=0)),
                              show_progress=False)
        self.engine = AsyncEngine(engine)
        self.group_id = context.replica_id.unique_id
        self.num_requests = 0
        self.num_aborted = 0  # left before the end (a client that went away)
        self.stream_interval_s = group_options.get("stream_interval_ms", 0) / 1e3
        self.outboxes = Outboxes(min_interval_s=self.stream_interval_s)  # streamed deltas, per ingress channel
        self._channels_seen: set[str] = set()  # channel ids named on Serve calls (through Ray)
        self._channelled: dict[str, str] = {}  # request id -> channel id, of those sent on a channel, running
        self._fetching: set[asyncio.Task] = set()
        self.num_channel_requests = 0
        self.channel_transport = group_options.get("channel_transport", "socket")
        self.channel_server: ChannelServer | None = None
        self._channel_address: asyncio.Task | None = None  # the socket's start, once
        self.allocator: AllocatorClient | None = None
        self.fetcher: KVFetcher | None = None
        self.step_timeout_s = group_options.get("step_timeout_s", DEFAULT_STEP_TIMEOUT_S)
        host_bytes = config.cache.host_kv_cache_memory
        if group_options.get("kv_allocator", True) and config.cache.enable_prefix_caching:
            self.allocator, host_bytes = self._link_allocator(engine, context.app_name, group_options, host_bytes)
        self.host_bytes = host_bytes
        if host_bytes:
            engine.enable_host_tier(host_bytes)
            if self.allocator is not None:
                self.fetcher = KVFetcher(self.engine, self.group_id, context.app_name,
                                         self.allocator.identity.kv_layout,
                                         mode=group_options.get("kv_fetch", "auto"))
        self.model_name = group_options.get("served_model_name") or config.model.model or "tandem-demo"
        self.metrics = None if not group_options.get("metrics", True) else start_group_metrics(
            self.engine, self.fetcher, {"application": context.app_name, "model": self.model_name,
                                        "replica_group": self.group_id},
            interval_s=group_options.get("metrics_interval_s", 1.0),
            probe_peaks=group_options.get("probe_device_peaks", True))
        self.healer: GroupHealer | None = None
        max_rebuilds = group_options.get("max_group_rebuilds", 3)
        if not engine.model_in_process and max_rebuilds > 0:  # a model in this process dies with it
            policy = HealPolicy(max_rebuilds=max_rebuilds,
                                timeout_s=group_options.get("group_rebuild_timeout_s", HealPolicy.timeout_s),
                                silent_s=self.step_timeout_s)  # as long as a step may hang
            self.healer = GroupHealer(self.engine, lambda failed: self._rebuilt(rebuild_engine(failed)),
                                      self._swapped, policy)
        logger.info("replica group %s ready: %d KV blocks", self.group_id,
                    self.engine.last_stats.get("kv_blocks_total", 0))

    def _rebuilt(self, engine: GroupEngine) -> GroupEngine:
        """A rebuilt engine, made what the failed one was: its host tier, its block events."""
        try:
            if self.host_bytes:
                engine.enable_host_tier(self.host_bytes)
            if self.allocator is not None:
                engine.enable_block_events()
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def _swapped(self, engine: GroupEngine) -> None:
        """Engine thread, the rebuilt engine in place: the allocator learns its (empty) cache."""
        if self.allocator is not None:
            self.allocator.resync(engine.num_kv_blocks)

    def _link_allocator(self, engine: GroupEngine, app_name: str, group_options: dict[str, Any],
                        host_ask: int) -> tuple[AllocatorClient, int]:
        """Register with the allocator (leasing the host tier first); returns (client, host bytes)."""
        import ray

        from tandem.workers.engine.kv_transfer import kv_layout

        identity = GroupIdentity(
            group_id=self.group_id, model_id=self.config.model.model or "tandem-demo",
            block_size=engine.block_size, device_blocks=engine.num_kv_blocks,
            node_id=ray.get_runtime_context().get_node_id(), kv_layout=kv_layout(self.config))
        budget = group_options.get("host_kv_memory_per_node")
        granted = self._lease_host(identity, get_or_create_allocator(app_name, budget), host_ask)
        identity = replace(identity, host_bytes=granted)
        client = AllocatorClient(lambda: get_or_create_allocator(app_name, budget), identity,
                                 wake_engine=self.engine.notify_step_listeners)
        engine.enable_block_events()
        self.engine.add_step_listener(
            lambda eng: client.submit(eng.drain_block_events(), eng.usage(), eng.cached_block_hashes))
        return client, granted

    @staticmethod
    def _lease_host(ident: GroupIdentity, allocator: Any, ask: int) -> int:
        """The host-tier bytes the node's budget grants this group (all of `ask` when the
        allocator cannot be reached: the budget is then not enforced, and we say so)."""
        if not ask:
            return 0
        import ray

        try:
            reply = ray.get(ident.register(allocator, [], host_bytes=ask), timeout=10)
            granted = reply["host_bytes"]
        except Exception as exc:  # noqa: BLE001 - serve anyway
            logger.warning("no host KV lease from the allocator (%s): using the %d bytes asked", exc, ask)
            return ask
        if granted < ask:
            logger.warning("host KV tier: asked for %d bytes, the node's budget granted %d", ask, granted)
        return granted

    async def export_prefix(self, request: PrefixExportRequest) -> PrefixExport:
        """Another group's fetch (kv_fetch.py): this group's device blocks for a hash chain."""
        if request.target_group != self.group_id:  # routed here by mistake: nothing
            return PrefixExport(0)
        num, per_rank = await self.engine.export_prefix(request.block_hashes)
        return PrefixExport(num, per_rank)

    async def generate(self, request: GroupRequest) -> AsyncIterator[GroupDelta | Accepted]:
        """Stream one request's deltas; a cancelled call aborts it and frees its blocks.
        `final_only`: one delta, when it finishes, with all of it. With a `channel_id`: one
        `Accepted`, then the deltas go over that channel (outbox.py) while the call stays
        open until the request ends."""
        if request.channel_id is None:
            async for delta in self._deltas(request):
                yield delta
            return
        self._channels_seen.add(request.channel_id)
        yield Accepted(self.group_id, await self._channel_socket())
        # The channel stays open until this request ends; its streams share the ingress's budget.
        pace = self.outboxes.begin(request.channel_id, request.chunks_per_s)
        try:
            await self._to_outbox(request, request.channel_id, pace)
        finally:
            self.outboxes.end(request.channel_id)

    async def _channel_socket(self) -> tuple[str, int] | None:
        """Where this group's channel socket listens (started by the first channelled request);
        None with `channel_transport` "serve", or when it cannot listen (then the ingresses
        read their channels through `channel` calls)."""
        if self.channel_transport != "socket":
            return None
        if self._channel_address is None:
            self._channel_address = asyncio.get_running_loop().create_task(self._start_channel_socket())
        elif self._channel_address.done():
            return self._channel_address.result()
        return await asyncio.shield(self._channel_address)

    async def _start_channel_socket(self) -> tuple[str, int] | None:
        import ray

        server = ChannelServer(self.group_id, self.outboxes, self)
        try:
            address = await server.start(ray.util.get_node_ip_address())
        except OSError as exc:
            logger.warning("replica group %s: no channel socket (%s); channels go through Serve calls",
                           self.group_id, exc)
            self.channel_transport = "serve"
            return None
        self.channel_server = server
        return address

    async def _to_outbox(self, request: GroupRequest, channel_id: str, pace: OutputPace) -> None:
        """Run a request whose outputs go straight into its channel's outbox as the engine hands
        them over (no task, no queue per request: a step's outputs are one loop callback);
        returns when it ends. Cancelled, it aborts the request."""
        self.num_requests += 1
        if self.fetcher is not None:
            await self.fetcher.fetch_for(request.prompt_token_ids)
        done = asyncio.get_running_loop().create_future()  # cancelled with this call, if it is
        self._start_to_outbox(request, channel_id, pace, done.done, lambda: done.set_result(True))
        try:
            await done
        finally:
            if done.cancelled():  # the call was cancelled (awaiting it cancels it): the client left
                self.engine.abort(request.request_id)
                self.num_aborted += 1

    def _start_to_outbox(self, request: GroupRequest, channel_id: str, pace: OutputPace,
                         ended: Callable[[], bool], end: Callable[[], None]) -> None:
        """Submit `request` to the engine, its outputs to `channel_id`'s outbox at the channel's
        `pace`; `end()` once its last delta is in. Outputs that come after `ended()` (it was
        aborted) are dropped."""

        self.engine.submit({"prompt_token_ids": request.prompt_token_ids},
                           replace(request.sampling, output_kind="delta"), request.request_id,
                           _ChannelDelivery(self, request, channel_id, ended, end, asyncio.get_running_loop()),
                           self._take_step, pace)

    def _take_step(self, items: list[tuple[Deliver, RequestOutput]]) -> None:
        """On the engine's thread: a step's outputs of requests streamed on channels, to their
        outboxes at once (outbox.py: written to a channel's socket from here while nothing of
        it waits); the loop hears only of the requests that ended."""
        by_channel: dict[str, list[GroupDelta]] = {}
        ended: list[tuple[_ChannelDelivery, RequestOutput]] = []
        for delivery, out in items:
            assert isinstance(delivery, _ChannelDelivery)
            if delivery.ended():  # aborted (the client left) before the engine heard of it
                continue
            by_channel.setdefault(delivery.channel_id, []).append(GroupDelta.from_output(out, self.group_id))
            if out.finished:
                ended.append((delivery, out))
        self.outboxes.put_step(by_channel)
        if ended:
            with suppress(RuntimeError):  # the loop closed: the replica is stopping
                ended[0][0].loop.call_soon_threadsafe(_end_all, ended)

    # ---- requests sent on a channel (ChannelRequests, channel_server.py) -----------------------
    def accepts(self, channel_id: str) -> bool:
        return channel_id in self._channels_seen

    def submit(self, request: GroupRequest) -> None:
        channel_id, request_id = request.channel_id, request.request_id
        assert channel_id is not None  # ChannelServer hands on only its channel's requests
        if request_id in self._channelled:
            self.outboxes.put(channel_id, self._failure(request, f"request_id: {request_id!r} is already in flight",
                                                        "invalid_request"))
            return
        self._channelled[request_id] = channel_id
        self.num_requests += 1
        self.num_channel_requests += 1
        pace = self.outboxes.begin(channel_id, request.chunks_per_s)  # the channel stays open until it ends

        def ended() -> bool:
            return self._channelled.get(request_id) != channel_id

        def end() -> None:
            if not ended():
                del self._channelled[request_id]
                self.outboxes.end(channel_id)

        if self.fetcher is None:
            self._start_to_outbox(request, channel_id, pace, ended, end)
        else:  # the prefix's blocks from another group first: a task (rare: host tier, several groups)
            task = asyncio.get_running_loop().create_task(
                self._fetch_then_start(request, channel_id, pace, ended, end))
            self._fetching.add(task)  # held: the loop keeps only a weak reference to a task
            task.add_done_callback(self._fetching.discard)

    async def _fetch_then_start(self, request: GroupRequest, channel_id: str, pace: OutputPace,
                                ended: Callable[[], bool], end: Callable[[], None]) -> None:
        assert self.fetcher is not None
        await self.fetcher.fetch_for(request.prompt_token_ids)
        if not ended():
            self._start_to_outbox(request, channel_id, pace, ended, end)

    def abort(self, request_id: str) -> None:
        channel_id = self._channelled.pop(request_id, None)
        if channel_id is None:  # ended already
            return
        self.engine.abort(request_id)
        self.num_aborted += 1
        self.outboxes.end(channel_id)

    def lost(self, channel_id: str) -> None:
        for request_id in [r for r, c in self._channelled.items() if c == channel_id]:
            self.abort(request_id)

    async def hold(self, opened: ChannelOpen) -> AsyncIterator[Accepted]:
        """Open while the channel's socket connection is: Serve's graceful stop of this group
        waits for this call, and so for the requests sent on the channel."""
        if opened.target_group != self.group_id or self.channel_server is None:
            return
        yield Accepted(self.group_id, self.channel_server.address)
        await self.channel_server.connection_ended(opened.channel_id)

    async def channel(self, opened: ChannelOpen) -> AsyncIterator[DeltaBatch]:
        """An ingress's channel: its streamed requests' deltas, one batch per flush, for as long
        as the ingress reads. Routed here by mistake (the group is gone): it ends at once, and
        the ingress fails its requests on that group."""
        if opened.target_group != self.group_id:
            return
        async for batch in self.outboxes.flushes(opened.channel_id):
            yield batch

    async def _deltas(self, request: GroupRequest) -> AsyncIterator[GroupDelta]:
        self.num_requests += 1
        if self.fetcher is not None:
            await self.fetcher.fetch_for(request.prompt_token_ids)
        finished = False
        try:
            async for out in self.engine.generate({"prompt_token_ids": request.prompt_token_ids},
                                                  request.sampling, request.request_id,
                                                  stream_interval_s=self.stream_interval_s,
                                                  final_only=request.final_only):
                finished = out.finished
                if finished and out.metrics is not None:
                    self._observe(request, out)
                yield GroupDelta.from_output(out, self.group_id)
        except ValueError as exc:  # refused by add_request (prompt too long for the cache, ...)
            finished = True
            yield self._failure(request, str(exc), "invalid_request")
        except EngineDeadError as exc:
            finished = True
            yield self._failure(request, str(exc), "unavailable")
        finally:
            if not finished:  # cancelled: AsyncEngine.generate has aborted it
                self.num_aborted += 1

    def _observe(self, request: GroupRequest, out: RequestOutput) -> None:
        """A finished request's histograms and trace spans (group_metrics.py, tracer.py)."""
        try:
            if self.metrics is not None:
                self.metrics.metrics.observe_request(out.metrics)
            tracer.record_group_spans(request.trace_context, out.metrics, group_id=self.group_id,
                                      model=self.model_name, request_id=request.request_id)
        except Exception:  # noqa: BLE001 - monitoring never fails a request
            logger.exception("recording request %s's metrics / spans failed", request.request_id)

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve for the request router (see router/request_router.py), and read by
        the KV report (router/kv_report.py) straight from the replica actor: the router's fields,
        and under GROUP_STATS_KEY the whole `stats()`. A call through a handle would wait behind
        generate calls for a slot (max_ongoing_requests) and reach only the replicas the
        caller's router knows; this actor method does neither."""
        stats = self.stats()
        return {**stats.routing.as_dict(), GROUP_STATS_KEY: stats.as_dict()}

    def _routing_stats(self) -> RoutingStats:
        stats = self.engine.last_stats
        # stats_time (wall clock): the router takes off the requests it saw finish since.
        return RoutingStats(is_healthy=self.engine.is_healthy, num_running=stats["num_running"],
                            num_waiting=stats["num_waiting"], kv_usage=stats["kv_usage"], stats_time=time.time(),
                            num_requests_total=self.num_requests, num_aborted_total=self.num_aborted)

    def stats(self, request: StatsRequest | None = None) -> GroupStats:
        """This group's figures (`StatsRequest(target_group=id)` routes the call to a given group)."""
        stats = self.engine.last_stats
        fetcher, healer = self.fetcher, self.healer
        return GroupStats(
            group_id=self.group_id, routing=self._routing_stats(), kv_blocks_total=stats["kv_blocks_total"],
            kv_blocks_free=stats["kv_blocks_free"], host_kv_blocks_total=stats.get("host_kv_blocks_total", 0),
            host_kv_blocks_used=stats.get("host_kv_blocks_used", 0),
            host_kv_blocks_pinned=stats.get("host_kv_blocks_pinned", 0),
            host_kv_blocks_loaded=stats.get("host_kv_blocks_loaded", 0),
            # Where its workers run (fault injection in `tandem bench soak`; none in-process).
            worker_pids=tuple(self.engine.worker_pids()),
            num_rebuilds=healer.num_rebuilds if healer is not None else 0,
            rebuilding=healer.healing if healer is not None else False,
            kv_fetches=fetcher.num_fetches if fetcher is not None else 0,
            kv_blocks_fetched=fetcher.num_blocks_fetched if fetcher is not None else 0,
            kv_fetches_failed=fetcher.num_failed if fetcher is not None else 0,
            channel_flushes=self.outboxes.num_flushes, channel_deltas=self.outboxes.num_deltas,
            channel_requests=self.num_channel_requests, channels_open=len(self.outboxes),
            num_preemptions=int(stats.get("num_preemptions", 0)))

    def check_health(self) -> None:
        """Serve replaces the replica when this raises: a failed group that is not being
        rebuilt in place (workers/serving/group_healer.py), or whose rebuild gave up."""
        if self.healer is not None:
            try:
                self.healer.check()
            except RuntimeError as exc:
                raise RuntimeError(f"replica group {self.group_id} has failed: {exc}") from None
            if self.healer.healing:
                return
        stalled = self.engine.step_running_for()
        if stalled > self.step_timeout_s:  # nothing failed, nothing moves: a hung device, a stopped worker
            error = (f"replica group {self.group_id} has stalled: one step has run for {stalled:.0f} s "
                     f"(step_timeout_s {self.step_timeout_s:g})")
            self.engine.fail_stalled(error)
            raise RuntimeError(error)
        if not self.engine.is_healthy:
            raise RuntimeError(f"replica group {self.group_id} has failed: {self.engine.dead_error}")

    def __del__(self) -> None:
        tracer.flush_on_stop(timeout_s=5.0)  # a graceful stop: the last spans still batched go out
        healer = getattr(self, "healer", None)
        if healer is not None:
            healer.close()
        allocator = getattr(self, "allocator", None)
        if allocator is not None:
            allocator.close()
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
        channel_server = getattr(self, "channel_server", None)
        if channel_server is not None:
            channel_server.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    # ---- deltas ------------------------------------------------------------------------------------
    def _failure(self, request: GroupRequest, message: str, kind: ErrorKind) -> GroupDelta:
        return GroupDelta.failure(request.request_id, self.group_id, message, kind)


class _ChannelDelivery:
    """One request streamed on a channel, as its outputs reach the group (`_take_step` on the
    engine's thread; called, on the loop, with an error: a refusal or a dead engine)."""

    __slots__ = ("server", "request", "channel_id", "ended", "end", "loop")

    def __init__(self, server: GroupServer, request: GroupRequest, channel_id: str, ended: Callable[[], bool],
                 end: Callable[[], None], loop: asyncio.AbstractEventLoop) -> None:
        self.server, self.request, self.channel_id = server, request, channel_id
        self.ended, self.end, self.loop = ended, end, loop

    def __call__(self, item: RequestOutput | BaseException) -> None:
        if self.ended():  # ended (or left) already
            return
        if isinstance(item, BaseException):
            kind: ErrorKind = "invalid_request" if isinstance(item, ValueError) else "unavailable"
            self.server.outboxes.put(self.channel_id, self.server._failure(self.request, str(item), kind))
            self.end()
            return
        self.server._take_step([(self, item)])  # not reached from the engine (it calls the sink)

    def finished(self, out: RequestOutput) -> None:
        """On the loop, after its last delta went to the outbox: its figures, and its end."""
        if self.ended():
            return
        if out.metrics is not None:
            self.server._observe(self.request, out)
        self.end()


def _end_all(ended: list[tuple[_ChannelDelivery, RequestOutput]]) -> None:
    for delivery, out in ended:
        delivery.finished(out)
