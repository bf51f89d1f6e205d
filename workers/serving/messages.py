"""Every message between the ingress and a replica group (and between two groups): the one
schema of that traffic. Both sides import these classes; Ray pickles them across.

    ingress ──GroupRequest──> GroupServer.generate ──GroupDelta, GroupDelta, ...──> ingress
    ingress ──GroupRequest(channel_id)──> GroupServer.generate ──Accepted──> ingress
    ingress ──ChannelOpen──> GroupServer.channel ──DeltaBatch, DeltaBatch, ...──> ingress
    ingress ──ChannelOpen──> the group's channel socket ──DeltaBatch, DeltaBatch, ...──> ingress
    ingress ──GroupRequest(channel_id), ChannelAbort──> (the same socket) the group
    ingress ──ChannelOpen──> GroupServer.hold ──Accepted──> ingress (open while the socket is)
    group A ──PrefixExportRequest──> GroupServer.export_prefix (of group B) ──PrefixExport──> A
    anyone  ──StatsRequest──> GroupServer.stats ──GroupStats──> (kv_report, bench soak)
    Serve   ──record_routing_stats──> RoutingStats.as_dict() ──> LoadAwareRouter

A streamed request names its ingress's channel (`channel_id`): the group then answers the
call with one `Accepted` and sends the request's deltas over the channel, a long-lived
connection from that ingress to that group that carries, as one `DeltaBatch` per flush, what
all the ingress's streams on the group produced (workers/serving/outbox.py,
router/group_channels.py). The channel is a TCP connection to the socket the group names in
`Accepted` (workers/serving/channel_server.py; frames of `encode_batch`), or, when it names
none, a streaming `GroupServer.channel` call.
The call itself stays open until the request ends: its cancellation is still the abort, and
its failure still says the group failed. A request answered whole (`final_only`) sends no
channel: its one delta is the call's answer.

While an ingress's router knows one group only (nothing to choose) and its socket channel to
that group is open, the ingress sends its streamed requests on the channel itself instead
of a call each: a `GroupRequest` frame, and a `ChannelAbort` frame when the client leaves or
the request's `timeout` passes. Such a request costs Ray and Serve nothing; the channel's
end (the group died, or the ingress did) ends it on both sides. A `hold` call stays open
while the socket does, so that Serve's graceful stop of the group waits for them.

An abort of a request sent on a call is no message: the ingress cancels the group call (the
client left, or its `timeout` passed), Serve cancels the group's generator, and that aborts
the request and frees its KV blocks (`AsyncEngine.generate`).

`target_group` on a request routes it to that group (request_router.py); `avoid_group`
sends a retried request elsewhere first.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.workers.core.request import (
    CompletionOutput,
    OutputJoiner,
    PositionLogprobs,
    RequestOutput,
    SamplingParams,
)

# invalid_request: the caller's fault (a 400, gRPC INVALID_ARGUMENT); unavailable: the group
# failed, and the request may be retried elsewhere if nothing of it was sent yet (a 503).
ErrorKind = Literal["invalid_request", "unavailable"]


@dataclass(frozen=True)
class GroupRequest:
    """One generation request, validated at the ingress (workers/core/validation.py)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # One delta when the request finishes, holding all of it: the group makes no output, and
    # sends no message, per token (a client that waits for the whole answer).
    final_only: bool = False
    trace_context: dict[str, str] | None = None  # a W3C carrier: the ingress span, when tracing
    avoid_group: str | None = None  # a retry: the group that failed it goes last
    channel_id: str | None = None  # deltas go over this ingress's channel, not the call
    # With a channel: the messages a second its ingress takes on that channel, all its streams
    # there together (0: no bound); the group paces the channel's streams to it (outbox.py).
    chunks_per_s: float = 0.0


@dataclass(frozen=True)
class Accepted:
    """A group's only answer on the call of a request sent with a channel: which group took it,
    and where its channel socket listens (None: the channel is a `GroupServer.channel` call)."""

    group_id: str
    channel_address: tuple[str, int] | None = None


@dataclass(frozen=True)
class ChannelOpen:
    """An ingress's channel to one group: every delta of its streamed requests on that group."""

    target_group: str
    channel_id: str


@dataclass(frozen=True)
class ChannelAbort:
    """Sent on a channel socket: end a request sent on it (the client left), free its KV blocks."""

    request_id: str


# What an ingress sends on its channel socket after its hello.
ChannelMessage = GroupRequest | ChannelAbort


def encode_channel_message(message: ChannelMessage) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode_channel_message(data: bytes) -> ChannelMessage:
    """A frame an ingress sent; ValueError for anything but a request or an abort."""
    message = pickle.loads(data)
    if not isinstance(message, (GroupRequest, ChannelAbort)):
        raise ValueError(f"not a channel message: {type(message).__name__}")
    return message


@dataclass(slots=True)
class DeltaBatch:
    """One flush of a channel: the deltas of any of the ingress's requests, each request's in order.

    It crosses Ray as one bytes object pickled by the standard (C) pickler: Ray's cloudpickle
    calls back into Python for every object it pickles, and a batch holds a few objects per
    stream per step."""

    deltas: list[GroupDelta]
    # The channel's last batch: it closes because it carried no request for a while (the
    # group is alive; the ingress opens it again when it needs it).
    closing: bool = False

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return decode_batch, (encode_batch(self),)


def _output_row(o: CompletionOutput) -> tuple:
    return o.index, o.text, o.token_ids, o.logprobs, o.finish_reason, o.stop_reason, o.cumulative_logprob


def encode_batch(batch: DeltaBatch) -> bytes:
    """A batch as rows of plain values, pickled by the C pickler (a channel socket's frame)."""
    rows = [(d.request_id, d.group_id, [_output_row(o) for o in d.outputs], d.finished, d.num_prompt_tokens,
             d.num_cached_tokens, d.prompt_logprobs, d.error, d.error_kind) for d in batch.deltas]
    return pickle.dumps((rows, batch.closing), protocol=pickle.HIGHEST_PROTOCOL)


def decode_batch(data: bytes) -> DeltaBatch:
    # Rows of plain values: the C unpickler builds them without a Python call per object.
    rows, closing = pickle.loads(data)
    return DeltaBatch([GroupDelta(rid, gid, [CompletionOutput(*o) for o in outputs], *rest)
                       for rid, gid, outputs, *rest in rows], closing)


@dataclass(slots=True)
class GroupDelta:
    """What a request produced since its last delta.

    `outputs` holds one entry per sequence that has news (index 0..n-1): its new text and
    token ids, their logprobs when asked for, and its finish reason once it ends. `error`
    (with `error_kind`) is set on the only delta of a request the group refused, or on the
    last one of a request the group failed."""

    request_id: str
    group_id: str
    outputs: list[CompletionOutput]
    finished: bool
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # With sampling prompt_logprobs: one entry per prompt token (None for the first), once.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @staticmethod
    def from_output(out: RequestOutput, group_id: str) -> GroupDelta:
        """The delta of an engine's delta output (an error on it: the group failed the request)."""
        # Positional: a keyword call costs twice as much, and this runs for every streamed output.
        return GroupDelta(out.request_id, group_id, out.outputs, out.finished, len(out.prompt_token_ids),
                          out.num_cached_tokens, out.prompt_logprobs, out.error, "unavailable" if out.error else None)

    @staticmethod
    def failure(request_id: str, group_id: str, message: str, kind: ErrorKind) -> GroupDelta:
        return GroupDelta(request_id, group_id, [], True, error=message, error_kind=kind)


class DeltaJoiner:
    """One delta that says what consecutive deltas of one request say, built as they arrive
    (a stream's deltas waiting for its next message to the client): per sequence its texts,
    token ids and logprobs joined (`OutputJoiner`), and the last one's finish and figures.
    While one delta waits it is kept as it is; from the second on, the joined lists and the
    latest delta, so waiting deltas are not kept as objects."""

    __slots__ = ("_outputs", "_last", "_num_prompt_tokens", "_prompt_logprobs", "count")

    def __init__(self, first: GroupDelta) -> None:
        self._outputs: OutputJoiner | None = None  # from the second delta on
        self._last = first
        self._num_prompt_tokens = first.num_prompt_tokens
        self._prompt_logprobs = first.prompt_logprobs
        self.count = 1  # deltas joined

    @property
    def finished(self) -> bool:
        return self._last.finished

    def add(self, delta: GroupDelta) -> None:
        if self._outputs is None:
            self._outputs = OutputJoiner()
            self._outputs.add(self._last.outputs)
        self._outputs.add(delta.outputs)
        self._last = delta
        self.count += 1
        if delta.num_prompt_tokens:
            self._num_prompt_tokens = delta.num_prompt_tokens
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = delta.prompt_logprobs

    def result(self) -> GroupDelta:
        if self._outputs is None:
            return self._last
        last = self._last  # field by field, not dataclasses.replace: once per streamed message
        return GroupDelta(last.request_id, last.group_id, self._outputs.result(), last.finished,
                          self._num_prompt_tokens, last.num_cached_tokens, self._prompt_logprobs, last.error,
                          last.error_kind)


@dataclass(frozen=True)
class PrefixExportRequest:
    """Another group's fetch (workers/serving/kv_fetch.py): this group's KV of a hash chain."""

    target_group: str
    block_hashes: list[int]


@dataclass(frozen=True)
class PrefixExport:
    num_blocks: int  # leading blocks of the chain exported
    per_rank: list[Any] = field(default_factory=list)  # object refs, one per rank


@dataclass(frozen=True)
class StatsRequest:
    target_group: str | None = None  # None: whichever group the router picks


# The key of a group's whole GroupStats among its routing stats (GroupServer.record_routing_stats).
GROUP_STATS_KEY = "group_stats"


@dataclass(frozen=True)
class RoutingStats:
    """A group's load, as Serve polls it for the request router. Serve carries it as a dict
    (`as_dict`); the router reads it back with `from_dict` ({} before the first poll)."""

    is_healthy: bool = True
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of the device KV blocks in use
    stats_time: float | None = None  # wall clock of the reading
    num_requests_total: int = 0
    num_aborted_total: int = 0  # left before the end (a client that went away)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, stats: Mapping[str, Any] | None) -> RoutingStats:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (stats or {}).items() if k in names})


@dataclass(frozen=True)
class GroupStats:
    """One group's figures: its load, KV blocks (device and host tier), workers, rebuilds and
    prefix fetches."""

    group_id: str
    routing: RoutingStats
    kv_blocks_total: int
    kv_blocks_free: int
    host_kv_blocks_total: int = 0
    host_kv_blocks_used: int = 0  # holding a cached block
    host_kv_blocks_pinned: int = 0  # held by a request (being loaded or fetched)
    host_kv_blocks_loaded: int = 0  # cumulative: loaded into the device cache
    worker_pids: tuple[int, ...] = ()  # the group's Ray workers (none with the model in its process)
    num_rebuilds: int = 0
    rebuilding: bool = False
    kv_fetches: int = 0
    kv_blocks_fetched: int = 0
    kv_fetches_failed: int = 0
    channel_flushes: int = 0  # cumulative: DeltaBatches sent on the ingresses' channels
    channel_deltas: int = 0  # cumulative: the deltas they carried
    channel_requests: int = 0  # cumulative: requests the ingresses sent on their channels, not as calls
    channels_open: int = 0  # the ingresses' channels being read now (or with deltas waiting)
    num_preemptions: int = 0  # cumulative, of this group's engine (a rebuilt one starts again)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, stats: Mapping[str, Any]) -> GroupStats:
        """As RoutingStats.from_dict: fields a newer group adds are left out (a report reads
        groups of another version during a rolling upgrade)."""
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in stats.items() if k in names}
        return cls(**{**known, "routing": RoutingStats.from_dict(stats["routing"]),
                      "worker_pids": tuple(stats["worker_pids"])})
