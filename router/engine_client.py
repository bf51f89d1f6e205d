"""EngineClient: the ingress's view of the replica groups (HTTP and gRPC share it).

It makes a request's `GroupRequest` (workers/serving/messages.py), validated before it
leaves the ingress (so a bad request never reaches, let alone hurts, a group); sends it
through a streaming `DeploymentHandle` (the request router picks the group), or, for a
streamed request while the router knows one group only, on this ingress's open channel to
that group (router/group_channels.py: no Serve call per request); and turns
what can go wrong on the way into two exception types: `ValueError` (the caller's fault:
a 400) and `ServiceUnavailable` (no group can take it now: a 503). Leaving the stream
early cancels the request in its group, which aborts it and frees its KV blocks at once.

A group that fails (its engine dead, its replica or a worker killed) ends the request's
stream with `ServiceUnavailable` as soon as Ray reports it, never a hang. A request that
has not yet yielded anything (no token can have reached the client) is sent once more,
steered away from the group that failed (`avoid_group`, see request_router.py). A request
with a deadline (`timeout`) that passes is cancelled the same way and ends with
`RequestTimeout`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine
from contextlib import aclosing
from dataclasses import replace
from typing import Any, TypeVar

from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RayServeException

from tandem.router import tracing
from tandem.router.grammar_check import GrammarCheck
from tandem.router.group_channels import ChannelLost, ChannelStream, GroupChannels
from tandem.router.known_groups import known_groups
from tandem.router.request_router import decisions_counter
from tandem.router.text_work import TextWork
from tandem.workers.core.request import SamplingParams
from tandem.workers.core.validation import PromptLimits, validate_prompt
from tandem.workers.serving import tracer
from tandem.workers.serving.messages import GroupDelta, GroupRequest

logger = logging.getLogger(__name__)

_HEALTH_TTL_S = 1.0
_HEALTH_MAX_AGE = 10  # in TTLs: older than this, a request waits for a fresh answer
# ... but for this long at most after that refresh began: Serve's controller answers through the
# GCS, and while the GCS is down (the head node failed) it does not answer at all, while the
# groups serve on. Past it the last known answer stands.
_STATUS_WAIT_S = 2.0
_ATTEMPTS = 2  # a request its group failed before answering is sent once more
_LAST_DELTA_GRACE_S = 10.0
T = TypeVar("T")


class ServiceUnavailable(Exception):
    """No replica group can serve the request now (overloaded, failed or not running)."""


class RequestTimeout(Exception):
    """The request's own deadline passed before it finished: it was aborted, its KV freed."""


class _GroupFailed(Exception):
    """The group serving an attempt failed (`group_id` when known): retried if nothing was sent."""

    def __init__(self, message: str, group_id: str | None = None) -> None:
        super().__init__(message)
        self.group_id = group_id


def sampling_params(options: dict[str, Any]) -> SamplingParams:
    """SamplingParams from an API request's options; ValueError names a bad or unknown field."""
    try:
        return SamplingParams(**options)
    except TypeError as exc:  # an unknown keyword
        raise ValueError(f"sampling: {exc}") from None


async def _before(awaitable: Awaitable[T], deadline: float | None) -> T:
    """`awaitable`'s result, or RequestTimeout once `deadline` (monotonic) passes."""
    if deadline is None:
        return await awaitable
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        if isinstance(awaitable, Coroutine):
            awaitable.close()
        raise RequestTimeout("the request's timeout passed before it finished")
    try:
        return await asyncio.wait_for(awaitable, remaining)
    except TimeoutError:
        raise RequestTimeout("the request's timeout passed before it finished") from None


async def _watch(response: Any, stream: ChannelStream, group_id: str) -> None:
    """A channelled request's call ends when the request does; a failure of it (the group's
    replica died) ends the request's stream. The call's end and the request's last delta
    travel apart: a last delta still missing `_LAST_DELTA_GRACE_S` after the call ended was
    lost with its channel, and the request fails rather than waits for ever."""
    try:
        async for _ in response:
            pass
    except (RayError, RayServeException) as exc:
        stream.put(_GroupFailed(type(exc).__name__, group_id))
        return
    await asyncio.sleep(_LAST_DELTA_GRACE_S)  # cancelled when the request ends first
    stream.put(_GroupFailed("its call ended but the request's last delta never came", group_id))


class EngineClient:
    def __init__(self, handle, *, tokenizer, model_name: str, max_model_len: int, vocab_size: int,
                 group_deployment: str = "GroupServer", channels: bool = True,
                 max_chunks_per_s: float = 0.0, request_timeout_s: float | None = None,
                 eos_token_ids: tuple[int, ...] = (), max_sent_on_channel: int = 0,
                 export_metrics: bool = True) -> None:
        """`channels`: streamed requests' deltas come over one channel per group (group_channels.py),
        their streams sharing `max_chunks_per_s` (0: no bound); False: each over its own call,
        one Ray message per delta. `request_timeout_s`: the deadline of a request that sets
        none of its own (None: none). `eos_token_ids`: the model's, where a grammar may end.
        `max_sent_on_channel`: streamed requests this ingress may have in flight on its channel
        to a sole group (its share of the group's `max_ongoing_requests`; past it they go
        through Serve, which queues them; 0: none go on the channel)."""
        self.request_timeout_s = request_timeout_s
        self.max_sent_on_channel = max_sent_on_channel
        self.export_metrics = export_metrics
        self._decisions: Any = None  # the router-decision counter, for requests sent on a channel
        self._app_name = getattr(handle, "app_name", "")
        self._deployment_name = getattr(handle, "deployment_name", group_deployment)
        self._handle = handle.options(stream=True)
        self.channels = (GroupChannels(self._handle, max_chunks_per_s, lambda: len(self._known_groups()))
                         if channels else None)
        self.tokenizer = tokenizer
        self.text = TextWork(tokenizer, max_model_len)  # tokenizing off the event loop
        self.grammar = GrammarCheck(self.text, vocab_size, eos_token_ids)  # structured outputs, compiled here first
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.prompt_limits = PromptLimits(vocab_size, max_model_len, max_tokens_must_fit=True)
        self._group_deployment = group_deployment
        # (checked at, every group healthy, some group running); refreshed at most every ~1 s
        self._status: tuple[float, bool, bool] = (-_HEALTH_TTL_S, True, True)
        self._refresh: asyncio.Task | None = None  # the one status read in flight (serve.status())
        self._refresh_began = 0.0
        self.num_running_groups = 1  # as last read from Serve (admission sizes its bound by it)
        self.group_states: dict[str, int] = {}  # the groups' count by Serve state, as last read

    # ---- requests ------------------------------------------------------------------------------
    def request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                final_only: bool = False, field: str = "prompt") -> GroupRequest:
        """A group request, checked as the group would check it plus the API's context-length
        rule for max_tokens; ValueError names the field (`field`: what the prompt came from).

        `final_only`: one delta, when the request finishes, holding all of it; for a caller
        that answers only at the end (a non-streaming request), which then costs the group no
        output, and Ray no message, per token."""
        validate_prompt(prompt_token_ids, params, self.prompt_limits, field)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is not in this model's vocabulary "
                             f"(its ids are below {self.vocab_size})")
        return GroupRequest(request_id, list(prompt_token_ids), params, final_only=final_only)

    async def stream(self, request: GroupRequest, deadline: float | None = None) -> AsyncIterator[GroupDelta]:
        """Yield the group's deltas for one request (see GroupServer.generate).

        `deadline` (time.monotonic()): past it the request is aborted with RequestTimeout. A
        request that has yielded nothing yet (a `final_only` one until it ends) is sent once
        more, elsewhere, if its group fails under it."""
        if not await self._can_serve_now():
            raise ServiceUnavailable("no replica group is running")
        if deadline is None and self.request_timeout_s is not None:  # no request lives for ever
            deadline = time.monotonic() + self.request_timeout_s
        carrier = tracer.inject()  # None when tracing is off
        if carrier is not None:
            request = replace(request, trace_context=carrier)
            tracing.note_group_request(self.model_name, request.sampling, response_id=request.request_id)
        yielded = False
        for attempt in range(_ATTEMPTS):
            try:
                # aclosing: a consumer that leaves early cancels the group call at once.
                async with aclosing(self._attempt(request, deadline)) as deltas:
                    async for delta in deltas:
                        yielded = True
                        yield delta
                return
            except _GroupFailed as exc:
                if yielded or attempt + 1 == _ATTEMPTS:
                    raise ServiceUnavailable(f"the replica group failed: {exc}") from None
                logger.warning("request %s: its replica group failed before answering (%s); retrying once "
                               "on another group", request.request_id, exc)
                request = replace(request, avoid_group=exc.group_id)

    async def _attempt(self, request: GroupRequest, deadline: float | None) -> AsyncIterator[GroupDelta]:
        """One group call; a failed group is `_GroupFailed`, whatever way Ray reports it."""
        if self.channels is not None and not request.final_only:
            deltas = self._over_channel(request, self.channels, deadline)
        else:
            deltas = self._over_call(request, deadline)
        num_output_tokens = 0
        finish_reasons: dict[int, str] = {}  # by choice: a finished choice of n > 1 repeats until all end
        try:
            async with aclosing(deltas):
                async for delta in deltas:
                    if delta.error:
                        if delta.error_kind == "invalid_request":
                            raise ValueError(delta.error)
                        raise _GroupFailed(delta.error, delta.group_id)
                    if request.trace_context is not None:
                        num_output_tokens += delta.num_output_tokens
                        finish_reasons.update((out.index, out.finish_reason) for out in delta.outputs
                                              if out.finish_reason)
                        if delta.finished:
                            tracing.note_usage(delta.num_prompt_tokens, num_output_tokens,
                                               [finish_reasons[i] for i in sorted(finish_reasons)])
                    yield delta
                    if delta.finished:
                        return
        except (BackPressureError, DeploymentUnavailableError) as exc:
            raise ServiceUnavailable(f"overloaded: {exc}") from None
        except (RayError, RayServeException) as exc:  # the replica or its actor died, or it raised
            raise _GroupFailed(type(exc).__name__) from exc
        except ChannelLost as exc:
            raise _GroupFailed(str(exc), exc.group_id) from None

    async def _over_call(self, request: GroupRequest, deadline: float | None) -> AsyncIterator[GroupDelta]:
        """The deltas as the call's own items; leaving before the last cancels the call."""
        response = self._handle.generate.remote(request)
        finished = False
        try:
            while not finished:
                try:
                    delta = await _before(anext(response), deadline)
                except StopAsyncIteration:  # the group's generator ended without a last delta
                    raise _GroupFailed("its stream ended before the request finished") from None
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                response.cancel()  # the group aborts it and frees its blocks

    async def _over_channel(self, request: GroupRequest, channels: GroupChannels,
                            deadline: float | None) -> AsyncIterator[GroupDelta]:
        """The call answers `Accepted`; the deltas come over this ingress's channel to that group.
        While the router knows one group only and this ingress's channel to it is open, the
        request goes on that channel, with no call."""
        stream = self._send_on_channel(request, channels)
        if stream is not None:
            async with aclosing(self._read_stream(stream, channels, deadline)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        stream = channels.open(request.request_id)
        response = self._handle.generate.remote(channels.with_channel(request))
        watcher: asyncio.Task | None = None
        finished = False
        try:
            try:
                accepted = await _before(anext(response), deadline)
            except StopAsyncIteration:
                raise _GroupFailed("its call ended before it accepted the request") from None
            channels.accepted(stream, accepted.group_id, accepted.channel_address)
            watcher = asyncio.get_running_loop().create_task(_watch(response, stream, accepted.group_id))
            async with aclosing(self._read_stream(stream, channels, deadline)) as deltas:
                async for delta in deltas:
                    finished = delta.finished
                    yield delta
        finally:
            channels.close(stream)  # (closed already, unless the call failed before it accepted)
            if watcher is not None:
                watcher.cancel()
            if not finished:
                response.cancel()  # the group aborts it and frees its blocks

    def _known_groups(self) -> frozenset[str]:
        """The groups this process's router for the deployment knows now (router/known_groups.py)."""
        return known_groups(self._app_name, self._deployment_name)

    def _send_on_channel(self, request: GroupRequest, channels: GroupChannels) -> ChannelStream | None:
        """The request's stream, sent on the channel to the only group the router knows; None
        when it goes through Serve (several groups, a retry, no open channel, or this ingress's
        share of the group's requests on the channel reached)."""
        if request.avoid_group is not None or self.max_sent_on_channel <= 0:
            return None
        groups = self._known_groups()
        if len(groups) != 1:
            return None
        (group_id,) = groups
        sender = channels.sender(group_id)
        if sender is None or channels.num_sent_to(group_id) >= self.max_sent_on_channel:
            return None
        started_ns = time.time_ns()
        stream = channels.submit(request, group_id, sender)
        if stream is not None:  # the decision, as the router records its own
            if self._decisions is None and self.export_metrics:
                self._decisions = decisions_counter(self._app_name)
            if self._decisions is not None:
                self._decisions.inc(1, tags={"decision": "only_group"})
            if request.trace_context is not None:
                tracing.record_route(request.trace_context, started_ns, time.time_ns(), {
                    "tandem.route.replica_group": group_id, "tandem.route.decision": "only_group",
                    "tandem.route.num_candidates": 1})
        return stream

    async def _read_stream(self, stream: ChannelStream, channels: GroupChannels,
                           deadline: float | None) -> AsyncIterator[GroupDelta]:
        """A channelled request's deltas from its stream, until the last. Leaving before it
        aborts a request sent on the channel there (one sent on a call: its caller cancels it).

        One timer for the request's deadline, not a timeout around every delta's await: that
        cost a task per token on the streamed path."""
        timer: asyncio.TimerHandle | None = None
        if deadline is not None:
            timer = asyncio.get_running_loop().call_later(
                max(0.0, deadline - time.monotonic()), stream.put,
                RequestTimeout("the request's timeout passed before it finished"))
        finished = False
        try:
            while not finished:
                delta = await stream.next()
                finished = delta.finished
                yield delta
        finally:
            if timer is not None:
                timer.cancel()
            channels.close(stream, abort=not finished)

    async def close(self) -> None:
        """The ingress is stopping: its channels close, its text pool stops."""
        if self.channels is not None:
            await self.channels.shutdown()
        self.text.shutdown()

    # ---- health --------------------------------------------------------------------------------
    async def groups_up(self) -> int:
        """Replica groups that can take requests now, as last known (0: none; see _can_serve_now)."""
        known = len(self._known_groups())
        if known:
            return known
        return max(1, self.num_running_groups) if await self._can_serve_now() else 0

    async def health(self) -> dict[str, Any]:
        """What a load balancer needs: `ready` while at least one replica group can take
        requests (the service serves), `all_healthy` when every group runs and passes its
        check, and the groups' count by Serve state (RUNNING, RECOVERING, STARTING, ...)."""
        all_healthy, can_serve = await self._group_status()
        return {"ready": can_serve, "all_healthy": all_healthy, "groups": dict(self.group_states)}

    async def _can_serve_now(self) -> bool:
        """Yes while this process's router knows a running group. Otherwise (no router here
        has run yet, or it knows none) Serve's status, as last read: a stale "yes" is refreshed
        in the background; a stale "no", or one with no refresh for `_HEALTH_MAX_AGE` TTLs
        (start-up, a stuck controller), is waited for, up to `_STATUS_WAIT_S` after its
        refresh began.

        (Waiting on every refresh put every request behind `serve.status()`, a controller
        round trip, once a second: under load that alone held time to first token above a
        second. Waiting without a bound held every request 10 s into a GCS outage until the
        GCS came back, and the raylets give up on it after 60 s.)
        """
        if self._known_groups():
            # Serve pushes each change of the running groups to this process's router: while
            # it knows one, a group serves, and no controller round trip is needed to say so.
            return True
        checked_at, _, can_serve = self._status
        age = time.monotonic() - checked_at
        if age >= _HEALTH_MAX_AGE * _HEALTH_TTL_S or (not can_serve and age >= _HEALTH_TTL_S):
            # Nothing recent, or a "no" that may be over: never refuse on a stale answer.
            _, can_serve = await self._group_status()
        elif age >= _HEALTH_TTL_S:
            self._refreshing()
        return can_serve

    async def _group_status(self) -> tuple[bool, bool]:
        """A fresh answer, or the last known one when the refresh has run `_STATUS_WAIT_S`."""
        checked_at, all_healthy, can_serve = self._status
        if time.monotonic() - checked_at < _HEALTH_TTL_S:
            return all_healthy, can_serve
        refresh = self._refreshing()
        try:
            # shield: a caller that stops waiting leaves the read running for the next one.
            return await asyncio.wait_for(asyncio.shield(refresh),
                                          max(0.0, self._refresh_began + _STATUS_WAIT_S - time.monotonic()))
        except TimeoutError:
            _, all_healthy, can_serve = self._status
            return all_healthy, can_serve

    def _refreshing(self) -> asyncio.Task:
        """The status read in flight, started if none is: one serve.status() at a time."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.get_running_loop().create_task(self._read_status())
            self._refresh_began = time.monotonic()
        return self._refresh

    async def _read_status(self) -> tuple[bool, bool]:
        # serve.status() asks the controller (a blocking call): a thread, never the loop.
        all_healthy, can_serve = await asyncio.to_thread(self._read_group_status)
        self._status = (time.monotonic(), all_healthy, can_serve)
        return all_healthy, can_serve

    def _read_group_status(self) -> tuple[bool, bool]:
        try:
            app = serve.get_replica_context().app_name
            deployment = serve.status().applications[app].deployments[self._group_deployment]
        except Exception:  # noqa: BLE001 - no controller or no app: report, and keep trying
            logger.exception("cannot read the replica groups' status")
            self.group_states = {}
            return False, True
        states = {str(getattr(k, "value", k)): n for k, n in deployment.replica_states.items()}
        num_running = states.get("RUNNING", 0)
        self.num_running_groups = num_running
        self.group_states = {state: n for state, n in states.items() if n}
        status = str(getattr(deployment.status, "value", deployment.status))
        # Serve marks a group UNHEALTHY when its check_health raises (a dead engine) and
        # replaces it; a RECOVERING one is being restarted.
        all_healthy = num_running >= 1 and status != "UNHEALTHY" and states.get("RECOVERING", 0) == 0
        return all_healthy, num_running >= 1
