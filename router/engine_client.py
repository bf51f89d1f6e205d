"""EngineClient: the ingress's view of the replica groups (HTTP and gRPC share it).

It validates a request before it leaves the ingress (so a bad request never reaches,
let alone hurts, a group), sends it through a streaming `DeploymentHandle` (the
request router picks the group), and turns what can go wrong on the way into two
exception types: `ValueError` (the caller's fault: a 400) and `ServiceUnavailable`
(no group can take it now: a 503). Leaving the stream early cancels the request in
its group, which aborts it and frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RayServeException

from tandem.router import tracing
from tandem.workers.core.request import SamplingParams

logger = logging.getLogger(__name__)

_HEALTH_TTL_S = 1.0
_HEALTH_MAX_AGE = 10  # in TTLs: older than this, a request waits for a fresh answer


class ServiceUnavailable(Exception):
    """No replica group can serve the request now (overloaded, failed or not running)."""


class EngineClient:
    def __init__(self, handle, *, tokenizer, model_name: str, max_model_len: int, vocab_size: int,
                 group_deployment: str = "GroupServer") -> None:
        self._handle = handle.options(stream=True)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._group_deployment = group_deployment
        # (checked at, every group healthy, some group running); refreshed at most every ~1 s
        self._status: tuple[float, bool, bool] = (-_HEALTH_TTL_S, True, True)
        self._status_lock: asyncio.Lock | None = None
        self._refresh: asyncio.Task | None = None

    # ---- validation ----------------------------------------------------------------------------
    def sampling_params(self, prompt_token_ids: list[int], sampling: dict[str, Any]) -> SamplingParams:
        """Validate one request as the group would, plus the context-length rule; ValueError names the field."""
        try:
            params = SamplingParams(**sampling)
        except TypeError as exc:  # an unknown keyword
            raise ValueError(f"sampling: {exc}") from None
        if not prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        bad = next((t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise ValueError(f"prompt: this model's maximum context length is {self.max_model_len} tokens, "
                             f"but the prompt has {num_prompt} (at least one must be left to generate)")
        if params.max_tokens is not None and num_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: this model's maximum context length is {self.max_model_len} tokens; "
                             f"the prompt has {num_prompt} and max_tokens asks for {params.max_tokens} more")
        return params

    # ---- requests ------------------------------------------------------------------------------
    async def stream(self, prompt_token_ids: list[int], sampling: dict[str, Any],
                     request_id: str) -> AsyncIterator[dict]:
        """Yield the group's delta dicts for one request (see GroupServer.generate)."""
        self.sampling_params(prompt_token_ids, sampling)
        if not await self._can_serve_now():
            raise ServiceUnavailable("no replica group is running")
        request = {"request_id": request_id, "prompt_token_ids": list(prompt_token_ids), "sampling": sampling}
        carrier = tracing.inject()  # None when tracing is off
        if carrier is not None:
            request[tracing.CARRIER_KEY] = carrier
            tracing.note_group_request(self.model_name, sampling)
        response = self._handle.generate.remote(request)
        finished = False
        num_output_tokens = 0
        try:
            async for delta in response:
                error = delta.get("error")
                if error:
                    if delta.get("error_type") == "invalid_request":
                        raise ValueError(error)
                    raise ServiceUnavailable(error)
                finished = delta["finished"]
                if carrier is not None:
                    num_output_tokens += sum(len(o.get("token_ids") or ()) for o in delta["outputs"])
                    if finished:
                        tracing.note_usage(delta.get("num_prompt_tokens") or 0, num_output_tokens)
                yield delta
                if finished:
                    return
        except (BackPressureError, DeploymentUnavailableError) as exc:
            raise ServiceUnavailable(f"overloaded: {exc}") from None
        except (RayActorError, RayServeException) as exc:
            raise ServiceUnavailable(f"the replica group failed: {type(exc).__name__}") from exc
        finally:
            if not finished:
                response.cancel()  # the group aborts it and frees its blocks

    # ---- health --------------------------------------------------------------------------------
    async def health(self) -> bool:
        """True when every replica group is running and passes its health check."""
        all_healthy, _ = await self._group_status()
        return all_healthy

    async def _can_serve_now(self) -> bool:
        """The last known answer: a stale "yes" is refreshed in the background; a stale "no",
        or one with no refresh for `_HEALTH_MAX_AGE` TTLs (start-up, a stuck controller), is
        waited for.

        (Waiting on every refresh put every request behind `serve.status()`, a controller
        round trip, once a second: under load that alone held time to first token above a
        second.)
        """
        checked_at, _, can_serve = self._status
        age = time.monotonic() - checked_at
        if age >= _HEALTH_MAX_AGE * _HEALTH_TTL_S or (not can_serve and age >= _HEALTH_TTL_S):
            # Nothing recent, or a "no" that may be over: never refuse on a stale answer.
            _, can_serve = await self._group_status()
        elif age >= _HEALTH_TTL_S and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.get_running_loop().create_task(self._group_status())
        return can_serve

    async def _group_status(self) -> tuple[bool, bool]:
        if self._status_lock is None:
            self._status_lock = asyncio.Lock()
        async with self._status_lock:
            checked_at, all_healthy, can_serve = self._status
            if time.monotonic() - checked_at >= _HEALTH_TTL_S:
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
            return False, True
        states = {str(getattr(k, "value", k)): n for k, n in deployment.replica_states.items()}
        num_running = states.get("RUNNING", 0)
        status = str(getattr(deployment.status, "value", deployment.status))
        # Serve marks a group UNHEALTHY when its check_health raises (a dead engine) and
        # replaces it; a RECOVERING one is being restarted.
        all_healthy = num_running >= 1 and status != "UNHEALTHY" and states.get("RECOVERING", 0) == 0
        return all_healthy, num_running >= 1
