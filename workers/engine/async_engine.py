"""AsyncEngine: a GroupEngine stepping on its own thread, with per-request async streams.

The engine object is touched by its thread only. Callers on the event loop post
commands (add, abort) to a queue the thread drains before each step; outputs come
back through `loop.call_soon_threadsafe` into one asyncio.Queue per request. So
nothing on the event loop ever blocks on model work, and a step never waits on a
caller. A failed engine (its group's workers died) can be replaced by a rebuilt one
(`replace_engine`; workers/serving/group_healer.py does it): streams and listeners stay.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from tandem.workers.core.output_pace import OutputPace
from tandem.workers.core.request import RequestOutput, SamplingParams, join_outputs
from tandem.workers.device_peaks import DevicePeaks
from tandem.workers.engine.engine_dead import EngineDeadError
from tandem.workers.engine.group_engine import GroupEngine
from tandem.workers.engine.kv_transfer import export_prefix, held_prefix, import_prefix
from tandem.workers.engine.prompts import Prompt
from tandem.workers.executor.abstract import WorkerProbe

logger = logging.getLogger(__name__)


Deliver = Callable[[RequestOutput | BaseException], None]  # called on the caller's event loop
# Called on the engine's thread after each step with the step's outputs of the requests
# submitted with it, each beside its `deliver` (which still gets their errors, on the loop).
StepSink = Callable[[list[tuple[Deliver, RequestOutput]]], None]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    deliver: Deliver
    sink: StepSink | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.deliver, item)


def _deliver_all(items: list[tuple[Deliver, RequestOutput]]) -> None:
    for deliver, item in items:
        deliver(item)


def _checked(item: RequestOutput | BaseException) -> RequestOutput:
    if isinstance(item, BaseException):
        raise item
    return item


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One delta output that says what two consecutive ones of a request said."""
    return replace(then, outputs=join_outputs((first.outputs, then.outputs)),
                   prompt_logprobs=then.prompt_logprobs if then.prompt_logprobs is not None else first.prompt_logprobs)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


class AsyncEngine:
    def __init__(self, engine: GroupEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # taken in (the engine thread's; `fail_stalled` while it is stuck)
        # Submitted, not yet taken in (by id(stream)): set by the caller's thread, popped by the
        # engine's when it takes the request in, or by `fail_stalled` while it cannot.
        self._pending: dict[int, _Stream] = {}
        self._stopped = False
        self.last_stats: dict[str, Any] = engine.stats()
        self._step_listeners: list[Callable[[GroupEngine], None]] = []
        self._failure_listeners: list[Callable[[GroupEngine], None]] = []
        self._failure_told = False  # the listeners heard of this engine's failure
        self._step_started: float | None = None  # monotonic, while a step runs (the stall watchdog's)
        self.stalled_error: str | None = None  # set by `fail_stalled`: nothing is taken any more
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_healthy(self) -> bool:
        return self.engine.dead_error is None and self._thread.is_alive()

    @property
    def dead_error(self) -> str | None:
        return self.engine.dead_error

    def step_running_for(self) -> float:
        """Seconds the step running now has taken (0 between steps): a hung device or a
        stopped worker shows here, where nothing fails."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    # The engine's figures below never change after start, or are single reads that are
    # safe off the engine thread.
    @property
    def block_size(self) -> int:
        return self.engine.block_size

    def kv_bytes_per_block(self) -> int:
        return self.engine.kv_bytes_per_block()

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.engine.prefill_tokens_per_s

    @property
    def model_in_process(self) -> bool:
        return self.engine.model_in_process

    def worker_pids(self) -> list[int]:
        return self.engine.worker_pids()

    def probe_workers(self) -> WorkerProbe:
        """The group's workers whose process is gone, and those that did not answer (a Ray call:
        never on the event loop)."""
        return self.engine.executor.probe_workers()

    # Read off the engine thread for the metrics reporter (see GroupEngine.metrics_snapshot).
    def metrics_snapshot(self) -> dict[str, float]:
        return self.engine.metrics_snapshot()

    def drain_token_intervals(self) -> list[float]:
        return self.engine.counters.drain_token_intervals()

    def probe_device_peaks(self) -> tuple[DevicePeaks, int] | None:
        """Before any request (start-up): nothing else runs on the device meanwhile."""
        return self.engine.probe_device_peaks()

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str,
                       stream_interval_s: float = 0.0, final_only: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream delta outputs of one request. Leaving the loop early aborts it.

        Deltas that are already waiting are merged into one. With `stream_interval_s` > 0,
        after the first delta (time to first token is never held back) the engine makes at
        most one output per interval, which says everything since the one before
        (workers/core/output_pace.py): fewer, larger messages for everything downstream,
        whose cost is per message, not per token.

        `final_only`: one output, when the request finishes, holding everything (a caller
        that answers only at the end: the engine then makes no per-step output, and decodes
        the text once, at the end, unless a stop string needs it as it grows).
        """
        params = replace(params, output_kind="final" if final_only else "delta")
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.submit(prompt, params, request_id, outputs.put_nowait,
                    pace=OutputPace(stream_interval_s) if stream_interval_s > 0 else None)
        finished = False
        try:
            while True:
                item = _checked(await outputs.get())
                while not item.finished and not outputs.empty():
                    item = merge_deltas(item, _checked(outputs.get_nowait()))
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def submit(self, prompt: Prompt, params: SamplingParams, request_id: str, deliver: Deliver,
               sink: StepSink | None = None, pace: OutputPace | None = None) -> None:
        """Start a request whose outputs (delta or final, as `params` say) go to `deliver`, on
        the calling event loop, each step's with one wake-up of the loop for all requests; an
        error (a refusal, a dead engine) is delivered as the exception. No task per request:
        for a caller that hands outputs on as they come (a group's outboxes). `abort` ends it.
        With `sink`, its outputs go to `sink` instead, on the engine's thread, with the step's
        other outputs for it, and no turn of the loop; errors still go to `deliver`. `pace`: at
        most one output per its interval after the first token (workers/core/output_pace.py)."""
        stream = _Stream(asyncio.get_running_loop(), deliver, sink)
        if self.stalled_error is not None:  # the engine thread will not come back for it
            stream.put(EngineDeadError(self.stalled_error))
            return
        self._pending[id(stream)] = stream
        if params.structured is None:
            self._post(lambda: self._add(request_id, prompt, params, stream, pace))
            return
        # A grammar compiles on a worker thread (milliseconds for a schema, once per schema), so
        # the step loop's own compile at add_request finds it compiled and no step waits for it.
        compiled = asyncio.get_running_loop().run_in_executor(None, self.engine.compile_grammar, params.structured)

        def queue(done: asyncio.Future) -> None:
            done.exception()  # retrieved: add_request compiles again and hands the caller the same error
            self._post(lambda: self._add(request_id, prompt, params, stream, pace))

        compiled.add_done_callback(queue)

    def fail_stalled(self, error: str) -> None:
        """The engine thread is stuck in a step (`step_running_for`): end every request now,
        from this thread, with `error` (their callers fail, or retry elsewhere, at once,
        instead of each waiting out its deadline), and refuse new ones. The group fails its
        health check until Serve replaces it, and its shutdown waits for neither the stuck
        thread nor its workers (`shutdown`). Nothing here blocks: it runs on the replica's
        health check."""
        self.stalled_error = error
        for key in list(self._pending):  # their commands wait behind the hung step
            stream = self._pending.pop(key, None)
            if stream is not None:
                stream.put(EngineDeadError(error))
        for request_id, stream in list(self._streams.items()):
            if self._streams.pop(request_id, None) is stream:
                stream.put(EngineDeadError(error))

    def add_step_listener(self, listener: Callable[[GroupEngine], None]) -> None:
        """Call `listener(engine)` on the engine thread after every step (keep it quick)."""
        self._post(lambda: self._step_listeners.append(listener))

    def add_failure_listener(self, listener: Callable[[GroupEngine], None]) -> None:
        """Call `listener(engine)` on the engine thread once when the engine fails (keep it quick)."""
        self._post(lambda: self._failure_listeners.append(listener))

    def replace_engine(self, engine: GroupEngine,
                       on_swapped: Callable[[GroupEngine], None] | None = None) -> None:
        """Serve from `engine` (a rebuilt group) in place of the failed one, between two steps;
        `on_swapped(engine)` runs on the engine thread right after, before any listener."""
        self._post(lambda: self._swap(engine, on_swapped))

    def fail_engine(self, error: str) -> None:
        """Fail the engine between two steps: its group was found broken outside a step (a
        worker died while the group was idle). Its requests end with the error."""
        self._post(lambda: self._fail_now(error))

    def notify_step_listeners(self) -> None:
        """Run the step listeners soon, even if the engine is idle."""
        self._post(self._after_step)

    def run_on_engine(self, fn: Callable[[GroupEngine], Any]) -> asyncio.Future:
        """Run `fn(engine)` on the engine thread between two steps; await its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def call() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._post(call)
        return future

    def abort(self, request_id: str) -> None:
        self._post(lambda: self._abort(request_id))

    # ---- prefix KV between groups (workers/engine/kv_transfer.py) ----------------------------------------
    def held_prefix(self, block_hashes: list[int]) -> int:
        """Leading blocks of the chain this group holds (an estimate: read off the engine thread)."""
        return held_prefix(self.engine, block_hashes)

    async def export_prefix(self, block_hashes: list[int]) -> tuple[int, list[Any]]:
        """(how many leading blocks of the chain are on the device, each rank's KV of them as
        an object ref): refs travel through the object store, not the caller's reply."""
        num, per_rank = await self.run_on_engine(lambda eng: export_prefix(eng, block_hashes))
        if per_rank and self.engine.model_in_process:
            import ray

            per_rank = [ray.put(data) for data in per_rank]
        return num, per_rank

    async def import_prefix(self, block_hashes: list[int], per_rank: list[Any]) -> int:
        """Put blocks another group exported (one object ref per rank) into the host tier;
        returns how many. Ray workers fetch their refs themselves; a model in this process
        gets them fetched here, on the event loop, so the engine thread never waits."""
        if self.engine.model_in_process:
            per_rank = list(await asyncio.gather(*per_rank))
        return await self.run_on_engine(lambda eng: import_prefix(eng, block_hashes, per_rank))

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        if self.stalled_error is not None:
            # Stuck in a step (`fail_stalled`): neither the thread nor a graceful teardown (it
            # would wait on a stopped worker) is waited for; the process is ending.
            self.engine.executor.abandon()
            return
        self._thread.join(timeout=30)
        self.engine.shutdown()

    # ---- engine thread ---------------------------------------------------------------------------
    def _post(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _add(self, request_id: str, prompt: Prompt, params: SamplingParams, stream: _Stream,
             pace: OutputPace | None) -> None:
        if self._pending.pop(id(stream), None) is None:  # failed by `fail_stalled` while it waited
            return
        try:
            self.engine.add_request(request_id, prompt, params, pace)
        except Exception as exc:  # bad input or a dead group: the caller gets the error
            stream.put(exc)
            return
        self._streams[request_id] = stream

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._streams.pop(request_id, None)

    def _fail_now(self, error: str) -> None:
        if self.engine.dead_error is not None:  # a step found it first
            return
        self._deliver(self.engine.give_up(error))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their streams: to each sink its requests' outputs in one call,
        here on the engine's thread (a group's channels, workers/serving/outbox.py); the rest
        with one wake-up of each event loop for all of them, so the loop sees the whole step at
        once, at one cross-thread call per step, not per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Deliver, RequestOutput]]] = {}
        by_sink: dict[StepSink, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                if stream.sink is None:
                    by_loop.setdefault(stream.loop, []).append((stream.deliver, out))
                else:
                    by_sink.setdefault(stream.sink, []).append((stream, out))
                if out.finished:
                    del self._streams[out.request_id]
        for sink, pairs in by_sink.items():
            try:
                sink([(stream.deliver, out) for stream, out in pairs])
            except Exception as exc:  # a sink's fault must not stop the engine: its requests fail
                logger.exception("step sink failed")
                for stream, out in pairs:
                    if self._streams.pop(out.request_id, None) is not None:
                        self.engine.abort_request(out.request_id)
                    stream.put(RuntimeError(f"the step's outputs were lost: {type(exc).__name__}: {exc}"))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver_all, items)

    def _tell_failure(self) -> None:
        """The failure listeners, once per failed engine."""
        if self.engine.dead_error is None or self._failure_told:
            return
        self._failure_told = True
        for listener in self._failure_listeners:
            try:
                listener(self.engine)
            except Exception:
                logger.exception("failure listener failed")

    def _swap(self, engine: GroupEngine, on_swapped: Callable[[GroupEngine], None] | None) -> None:
        old, self.engine = self.engine, engine
        self._failure_told = False
        if on_swapped is not None:
            on_swapped(engine)
        # fail() ended every request the old engine held; a stream still open here would
        # never hear from the new one.
        for stream in self._streams.values():
            stream.put(EngineDeadError(f"the replica group was rebuilt: {old.dead_error}"))
        self._streams.clear()
        self._after_step()

    def _after_step(self) -> None:
        self.last_stats = self.engine.stats()
        self._tell_step_listeners()

    def _tell_step_listeners(self) -> None:
        for listener in self._step_listeners:
            try:
                listener(self.engine)
            except Exception:  # a listener (the allocator link) must never stop serving
                logger.exception("step listener failed")

    def _loop(self) -> None:
        while not self._stopped:
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            self._tell_failure()
            if not self.engine.has_unfinished_requests():
                self._after_step()
                self._wake.wait()
                self._wake.clear()
                continue
            self._step_started = time.monotonic()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # the step loop never swallows: fail every stream loudly
                logger.exception("engine step failed")
                outputs = self.engine.fail(f"{type(exc).__name__}: {exc}")
            finally:
                self._step_started = None
            # The figures before the outputs: a stream's client that has its token must find
            # the step that made it counted (the KV report, the router's load), not the last.
            self.last_stats = self.engine.stats()
            self._deliver(outputs)
            self._tell_step_listeners()
            self._tell_failure()
