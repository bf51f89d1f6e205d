"""`tandem bench soak`: load past capacity, faults while it runs; nothing lost, nothing leaked.

Against a server it starts (the demo model, two TP=2 groups, HTTP and gRPC) or `--url`:

    hostile    hostile requests alone (huge n, shared client ids, tiny temperatures, large
               logprobs, long stop lists...), a few at a time: `groups_hurt_by_one_request`
               counts the groups that failed, restarted or were rebuilt meanwhile (target 0)
    capacity   a closed loop of valid requests: the deployment's capacity (req/s) and its
               goodput there (completed requests per second)
    overload   the mix (soak_mix.py) as a Poisson stream at `overload` x capacity
    faults     the mix at `fault_load` x capacity while each of `faults` (soak_faults.py) is
               injected in turn and the deployment recovers from it: at least
               `fault_requests`, and on until the last fault's recovery
    drain      every request answered, the KV blocks still held (kv_report.py, through
               `RouterHooks.kv_holdings` here or `GET /admin/kv` with `--url`) must reach 0

then a sample of the completed greedy outputs is checked against the offline engine.
Every request ends in exactly one outcome (soak_client.py); `sent` is their sum. A request
not yet answered when the client's deadline (`timeout` + a grace) passes is `lost`.
`overload_goodput_ratio` = goodput under overload / goodput at capacity.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.bench.load_generator import arrival_offsets, httpx
from tandem.bench.preemption_tally import PreemptionTally
from tandem.bench.report import log_progress
from tandem.bench.soak_client import OUTCOMES, GrpcClient, Outcome, send_grpc, send_http
from tandem.bench.soak_faults import FAULT_KINDS, FaultInjector, FaultRecord
from tandem.bench.soak_mix import MixSpec, SoakRequest, make_mix
from tandem.workers.config import CacheConfig

KV_PRESSURE_SEQUENCES = 4  # full contexts a group's KV cache holds in the soak's server
LONG_PROMPT_FRACTION = 0.5  # a prompt longer than this share of the context counts as long (long_share)
FAULT_SETTLE_S = 5.0  # a fault's injection and first recovery checks, beside its gap and timeout
DEADLINE_GRACE_S = 20.0  # the client waits this long past a request's own timeout before calling it lost


@dataclass(frozen=True)
class SoakConfig:
    capacity_requests: int = 96
    capacity_concurrency: int = 16
    overload_requests: int = 600
    fault_requests: int = 600
    hostile_requests: int = 48  # sent alone, before the capacity phase
    overload: float = 4.0
    faults: tuple[str, ...] = FAULT_KINDS
    fault_gap_s: float = 5.0  # load before each fault
    fault_load: float = 1.0  # the fault phase's rate, x capacity
    num_groups: int = 2  # of the server the bench starts
    recovery_timeout_s: float = 120.0  # a fault not recovered from by then: recovery_s None (inf in the max)
    max_duration_s: float = 1200.0  # no request is sent after this
    check_sample: int = 32  # completed outputs checked against the offline engine
    drain_timeout_s: float = 45.0  # for the KV held to reach 0 (a killed group's lease lapses in ~10 s)
    mix: MixSpec = field(default_factory=MixSpec)
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"faults: unknown {', '.join(sorted(unknown))} (known: {', '.join(FAULT_KINDS)})")
        if not self.overload > 0:
            raise ValueError(f"overload: must be > 0, got {self.overload}")


SOAK_FULL = SoakConfig()
HOSTILE_FIRST_INDEX = 1_000_000  # the hostile phase's request indices: apart from every other phase's
HOSTILE_CONCURRENCY = 4
HEALTH_SETTLE_S = 3.0  # Serve's health checks (1 s apart) see a failed group within this
# The server the soak starts finds a stalled group this fast (the default, 30 s, is for a
# model's slowest steps; the soak's tiny model steps in milliseconds): recovery within 30 s.
SOAK_STEP_TIMEOUT_S = 10.0
SOAK_QUICK = SoakConfig(capacity_requests=12, capacity_concurrency=6, overload_requests=30, fault_requests=24,
                        hostile_requests=12, faults=("allocator", "worker", "stall"), fault_gap_s=1.0,
                        fault_load=0.5, num_groups=1,
                        recovery_timeout_s=60.0, max_duration_s=90.0, check_sample=6, drain_timeout_s=30.0,
                        mix=MixSpec(num_prefixes=3, prefix_len=32, output_len=(4, 16), timeout_s=20.0))


@dataclass(frozen=True)
class Target:
    """The server under test, and what the soak may do to it."""

    url: str
    model: str | None  # the model name to send
    vocab_size: int
    max_model_len: int
    grpc_address: str | None = None
    grpc_messages: Any = None  # the gRPC API's message module
    api_key: str | None = None
    app_name: str | None = None  # the bench's own server: faults and in-process KV reports
    kv_holdings: Callable[[str], dict[str, Any]] | None = None
    num_groups: int = 2


class Soak:
    def __init__(self, target: Target, cfg: SoakConfig, show_progress: bool = True) -> None:
        self.target = target
        self.cfg = cfg
        self.show_progress = show_progress
        self.outcomes: dict[str, list[Outcome]] = {}
        self.faults: list[FaultRecord] = []
        self.groups_hurt: int | None = None  # in the hostile phase; None: not run, or no KV report
        self.phase_s: dict[str, float] = {}
        self.kv_report: dict[str, Any] | None = None
        self.preemptions = PreemptionTally()  # every KV report read feeds it
        self.zero = time.monotonic()
        self._bar: Any = None

    # ---- the run -------------------------------------------------------------------------------
    async def run(self) -> None:
        t = self.target
        headers = {"Authorization": f"Bearer {t.api_key}"} if t.api_key else {}
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
        async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(None)) as http:
            self.http = http
            self.grpc = GrpcClient(t.grpc_address, t.grpc_messages, t.api_key) if t.grpc_address else None
            try:
                await self._run_phases()
            finally:
                if self.grpc is not None:
                    await self.grpc.close()
            self.kv_report = await self._drained_kv()

    async def _run_phases(self) -> None:
        cfg, t = self.cfg, self.target
        mix = dataclasses.replace(cfg.mix, grpc_share=cfg.mix.grpc_share if self.grpc else 0.0)
        make = lambda n, seed, first, valid_only=False: make_mix(  # noqa: E731
            n, mix, t.vocab_size, t.max_model_len, seed=seed, grpc=self.grpc is not None, first_index=first,
            valid_only=valid_only)
        self._progress(cfg.hostile_requests + cfg.capacity_requests + cfg.overload_requests + cfg.fault_requests)
        await self._closed_loop("warmup", make(2, cfg.seed - 1, -2, valid_only=True), 2)
        if cfg.hostile_requests:
            # Drawn from the mix (indices of their own), the hostile ones only, with nothing else running.
            drawn = make(cfg.hostile_requests * 40, cfg.seed - 2, HOSTILE_FIRST_INDEX)
            hostile = [r for r in drawn if r.is_hostile][:cfg.hostile_requests]
            before = await self._group_states()
            await self._closed_loop("hostile", hostile, HOSTILE_CONCURRENCY)
            await asyncio.sleep(HEALTH_SETTLE_S)  # a group a request killed is found by then
            self.groups_hurt = _groups_hurt(before, await self._group_states())
        capacity = make(cfg.capacity_requests, cfg.seed, 0, valid_only=True)
        await self._closed_loop("capacity", capacity, cfg.capacity_concurrency)
        self.capacity_req_s = self._goodput("capacity")
        rate = max(self.capacity_req_s, 0.1)
        overload = make(cfg.overload_requests, cfg.seed + 1, len(capacity))
        await self._open_loop("overload", overload, rate * cfg.overload)
        # Enough requests to go on through every recovery (only the ones sent count), within bounds:
        # each fault may take its gap and its whole recovery timeout, and the load must not run dry
        # before the last one (a 120 s worker fault once used the whole supply, so the later
        # faults were injected into idle groups).
        fault_window_s = min(len(cfg.faults) * (cfg.fault_gap_s + cfg.recovery_timeout_s + FAULT_SETTLE_S),
                             cfg.max_duration_s)
        supply = max(cfg.fault_requests * 4, math.ceil(rate * cfg.fault_load * fault_window_s))
        faulted = make(supply, cfg.seed + 2, len(capacity) + len(overload))
        faults_done = asyncio.Event()

        async def inject() -> None:
            try:
                await self._inject_faults()
            finally:
                faults_done.set()

        await asyncio.gather(self._open_loop("faults", faulted, rate * cfg.fault_load,
                                             until=lambda n: n >= cfg.fault_requests and faults_done.is_set()),
                             inject())
        if self._bar is not None:
            self._bar.close()

    async def _closed_loop(self, phase: str, requests: list[SoakRequest], concurrency: int) -> None:
        pending = list(reversed(requests))
        outcomes: list[Outcome] = []
        start = time.monotonic()

        async def worker() -> None:
            while pending:
                outcomes.append(await self._send(pending.pop()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        self.outcomes[phase] = outcomes
        self.phase_s[phase] = time.monotonic() - start

    async def _open_loop(self, phase: str, requests: list[SoakRequest], rate: float,
                         until: Callable[[int], bool] = lambda n: False) -> None:
        """Send `requests` as a Poisson stream of `rate` until they run out, `until(number sent)`
        says so, or the soak's time is up; then wait for every answer."""
        start = time.monotonic()
        tasks = []
        for req, offset in zip(requests, arrival_offsets(len(requests), rate, self.cfg.seed + len(phase))):
            if until(len(tasks)):
                break
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            if time.monotonic() - self.zero > self.cfg.max_duration_s:
                break  # bounded in time as well as in count
            tasks.append(asyncio.create_task(self._send(req)))
        self.outcomes[phase] = list(await asyncio.gather(*tasks))
        self.phase_s[phase] = time.monotonic() - start

    async def _send(self, req: SoakRequest) -> Outcome:
        timeout_s = self.cfg.mix.timeout_s
        deadline_s = timeout_s + DEADLINE_GRACE_S
        if req.api == "grpc":
            out = await send_grpc(self.grpc, req, timeout_s=timeout_s, deadline_s=deadline_s)
        else:
            out = await send_http(self.http, self.target.url, req, model=self.target.model, timeout_s=timeout_s,
                                  deadline_s=deadline_s)
        if self._bar is not None:
            if self._bar.n >= self._bar.total:  # the fault phase goes on through recoveries
                self._bar.total += 1
            self._bar.update(1)
        return out

    async def _inject_faults(self) -> None:
        if not self.cfg.faults:
            return
        injector = FaultInjector(self.target.app_name, self._holdings, self._probe, num_groups=self.target.num_groups,
                                 recovery_timeout_s=self.cfg.recovery_timeout_s, clock_zero=self.zero)
        for kind in self.cfg.faults:
            await asyncio.sleep(self.cfg.fault_gap_s)
            log_progress("soak", self.show_progress, f"fault: {kind}")
            record = await injector.inject(kind)
            self.faults.append(record)
            log_progress("soak", self.show_progress, f"fault {kind} ({record.target}): serving again after "
                         f"{_fmt(record.serving_again_s)} s, recovered after {_fmt(record.recovery_s)} s"
                         + (f"; {record.error}" if record.error else "")
                         + (f"; short of strength: {record.short_of_strength}" if record.short_of_strength else ""))

    # ---- the server's state --------------------------------------------------------------------
    async def _group_states(self) -> dict[str, tuple[bool, int]] | None:
        """Each group's (healthy, rebuilds) as the KV report has them; None: no report."""
        try:
            groups = (await self._holdings())["groups"]
        except Exception:  # noqa: BLE001 - a server without /admin/kv: the figure is unknown
            return None
        return {gid: (g["healthy"], g.get("num_rebuilds", 0)) for gid, g in groups.items()}

    async def _holdings(self) -> dict[str, Any]:
        if self.target.kv_holdings is not None and self.target.app_name is not None:
            report = await asyncio.to_thread(self.target.kv_holdings, self.target.app_name)
        else:
            response = await self.http.get(self.target.url + "/admin/kv", timeout=30)
            response.raise_for_status()
            report = response.json()
        self.preemptions.read(report)
        return report

    async def _probe(self) -> bool:
        body = {"prompt": [7, 8, 9], "max_tokens": 2, "temperature": 0.0, "timeout": 10.0}
        if self.target.model:
            body["model"] = self.target.model
        try:
            response = await self.http.post(self.target.url + "/v1/completions", json=body, timeout=15)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _drained_kv(self) -> dict[str, Any] | None:
        """The KV report once nothing is held (or the drain timeout's last one); None: unavailable."""
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        report = None
        while True:
            try:
                report = await self._holdings()
            except Exception as exc:  # noqa: BLE001 - a server without /admin/kv: say so
                log_progress("soak", self.show_progress, f"no KV report: {type(exc).__name__}: {exc}")
                return report
            if _leaked(report) == 0 and report["requests_in_flight"] == 0 and not report["unreachable_groups"]:
                return report
            if time.monotonic() > deadline:
                return report
            await asyncio.sleep(1.0)

    # ---- figures -------------------------------------------------------------------------------
    def _goodput(self, phase: str) -> float:
        done = sum(1 for o in self.outcomes.get(phase, ()) if o.kind == "completed")
        seconds = self.phase_s.get(phase, 0.0)
        return done / seconds if seconds > 0 else 0.0

    def _progress(self, total: int) -> None:
        if self.show_progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total + 2, desc="soak", unit="req", dynamic_ncols=True)

    def all_outcomes(self) -> list[Outcome]:
        return [o for phase, outs in self.outcomes.items() if phase != "warmup" for o in outs]

    def figures(self, wrong_output: int | None, num_checked: int) -> dict[str, Any]:
        outs = self.all_outcomes()
        counts = Counter(o.kind for o in outs)
        figures: dict[str, Any] = {
            "sent": len(outs), **{kind: counts.get(kind, 0) for kind in OUTCOMES},
            "wrong_output": wrong_output, "wrong_output_checked": num_checked,
            "rejected_with_retry_after": sum(1 for o in outs if o.kind == "rejected" and o.retry_after),
            "hostile_requests": sum(1 for o in outs if o.request.is_hostile),
            "groups_hurt_by_one_request": self.groups_hurt,
            "leaked_kv_blocks": None if self.kv_report is None else _leaked(self.kv_report),
        }
        if self.kv_report is not None:
            for key in ("device_blocks_held", "host_blocks_held", "stale_lease_blocks", "requests_in_flight"):
                figures[f"drained_{key}"] = self.kv_report[key]
            figures["drained_unreachable_groups"] = len(self.kv_report["unreachable_groups"])
            # Every engine's, a rebuilt or replaced group's included (a lower bound: PreemptionTally).
            figures["preemptions"] = self.preemptions.total
        valid = [o for o in outs if not o.request.invalid]
        figures["long_prompts"] = sum(1 for o in valid if len(o.request.prompt_token_ids) > LONG_PROMPT_FRACTION
                                      * self.target.max_model_len)
        figures["slow_readers"] = sum(1 for o in valid if o.request.slow)
        figures["slow_readers_completed"] = sum(1 for o in valid if o.request.slow and o.kind == "completed")
        figures["capacity_req_s"] = self.capacity_req_s
        figures["goodput_capacity_req_s"] = self._goodput("capacity")
        figures["goodput_overload_req_s"] = self._goodput("overload")
        figures["overload_rate_req_s"] = self.capacity_req_s * self.cfg.overload
        cap = figures["goodput_capacity_req_s"]
        figures["overload_goodput_ratio"] = figures["goodput_overload_req_s"] / cap if cap > 0 else math.nan
        for phase, outs_ in self.outcomes.items():
            figures[f"{phase}_s"] = self.phase_s[phase]
            for kind, n in sorted(Counter(o.kind for o in outs_).items()):
                figures[f"{phase}_{kind}"] = n
        recoveries = [f.recovery_s for f in self.faults]
        figures["recovery_s_max"] = (math.inf if any(r is None for r in recoveries) else max(recoveries)) \
            if recoveries else None
        figures["faults"] = ",".join(f.kind for f in self.faults)
        for f in self.faults:
            figures[f"fault_{f.kind}_target"] = f.target
            figures[f"fault_{f.kind}_at_s"] = f.injected_at
            figures[f"fault_{f.kind}_serving_again_s"] = f.serving_again_s
            figures[f"fault_{f.kind}_recovery_s"] = f.recovery_s
            if f.error:
                figures[f"fault_{f.kind}_error"] = f.error
            if f.short_of_strength:
                figures[f"fault_{f.kind}_short_of_strength"] = f.short_of_strength
        for kind in ("lost", "unexpected_5xx", "failed_abrupt", "invalid_accepted", "failed_clean", "rejected"):
            first = next((o for o in outs if o.kind == kind), None)
            if first is not None:
                figures[f"example_{kind}"] = f"{first.status} {first.detail}"[:300]
        return figures

    def check_sample(self) -> list[Outcome]:
        """Completed greedy requests whose outputs the offline engine checks (a seeded sample)."""
        done = [o for o in self.all_outcomes() if o.kind == "completed" and o.request.checkable]
        return random.Random(self.cfg.seed).sample(done, min(self.cfg.check_sample, len(done)))


def _leaked(report: dict[str, Any]) -> int:
    return report["device_blocks_held"] + report["host_blocks_held"] + report["stale_lease_blocks"]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def count_wrong_outputs(model_dir: str, sample: list[Outcome], engine_options: dict[str, Any] | None = None) -> int:
    """Sampled outputs that differ from the offline engine's greedy ones (token ids over gRPC, text over HTTP)."""
    if not sample:
        return 0
    from tandem.workers.core.request import SamplingParams
    from tandem.workers.llm import LLM

    llm = LLM(model=model_dir, **(engine_options or {}))
    try:
        wrong = 0
        for out in sample:
            req = out.request
            params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
            [ref] = llm.generate([{"prompt_token_ids": req.prompt_token_ids}], params, use_tqdm=False)
            got, want = (out.token_ids, list(ref.outputs[0].token_ids)) if req.api == "grpc" else (
                out.text, ref.outputs[0].text)
            wrong += got != want
    finally:
        llm.shutdown()
    return wrong


# ---- the command ---------------------------------------------------------------------------------
def run_soak(cfg: SoakConfig, *, url: str | None, grpc_address: str | None = None, served_model: str | None = None,
             api_key: str | None = None, model: str | None = None, engine_options: dict[str, Any] | None = None,
             local_app: Callable[[dict[str, Any]], Any] | None = None,
             kv_holdings: Callable[[str], dict[str, Any]] | None = None, grpc_servicer: str | None = None,
             grpc_messages: Callable[[], Any] | None = None, num_groups: int | None = None,
             tensor_parallel_size: int = 2,
             show_progress: bool = True) -> dict[str, Any]:
    """The soak's figures (one flat dict). With `url`: that server (faults need the bench's own,
    of `num_groups` groups: default 2, with `--quick` 1, so that CI starts one TP=2 group)."""
    from tandem.bench.server import SERVED_MODEL_NAME, bench_server
    from tandem.workers.model.demo_model import demo_model_path
    from tandem.workers.model.hf_config import HFModelConfig

    pb = grpc_messages() if grpc_messages is not None else None
    figures: dict[str, Any] = {"faults_planned": ",".join(cfg.faults), "overload": cfg.overload,
                               "request_timeout_s": cfg.mix.timeout_s}
    if url is not None:
        if cfg.faults:
            raise ValueError("--faults need the server the bench starts (it kills its processes): "
                             "with --url pass --faults none")
        hf = HFModelConfig.from_dir(model) if model else None
        target = Target(url.rstrip("/"), served_model, hf.vocab_size if hf else 1000,
                        hf.max_position_embeddings if hf else 2048,
                        grpc_address=grpc_address if pb is not None else None, grpc_messages=pb, api_key=api_key)
        soak = _run(target, cfg, show_progress)
        wrong = count_wrong_outputs(model, soak.check_sample(), engine_options) if model else None
        return {**figures, "url": target.url, **soak.figures(wrong, len(soak.check_sample()) if model else 0)}
    if local_app is None:
        raise ValueError("serving tandem here needs local_app, or give a url")
    from tandem.cluster.net import free_port

    num_groups = num_groups or cfg.num_groups
    model_dir = os.path.abspath(model or demo_model_path())
    hf = HFModelConfig.from_dir(model_dir)
    options = {**(engine_options or {}), "model": model_dir, "num_replicas": num_groups,
               "tensor_parallel_size": tensor_parallel_size}
    if "stall" in cfg.faults:
        options["step_timeout_s"] = SOAK_STEP_TIMEOUT_S
        figures["step_timeout_s"] = SOAK_STEP_TIMEOUT_S
    if cfg.mix.long_share > 0 and "num_kv_blocks" not in options and "kv_cache_memory" not in options:
        # KV pressure: a group's cache holds KV_PRESSURE_SEQUENCES full contexts, so a few
        # context-filling prompts among the rest force preemptions.
        max_len = options.get("max_model_len") or hf.max_position_embeddings
        block_size = options.get("block_size") or CacheConfig.block_size
        options["num_kv_blocks"] = KV_PRESSURE_SEQUENCES * -(-max_len // block_size)
        figures["num_kv_blocks"] = options["num_kv_blocks"]
    address = options.pop("address", None)
    grpc = (free_port(), grpc_servicer) if grpc_servicer and pb is not None else None
    num_cpus = max(os.cpu_count() or 1, num_groups * (1 + tensor_parallel_size)) + 4
    log_progress("soak", show_progress, f"starting the server: {num_groups} group(s) of TP={tensor_parallel_size}")
    with bench_server(local_app, {"": options}, num_cpus=num_cpus, address=address, grpc=grpc) as urls:
        target = Target(urls[""], SERVED_MODEL_NAME, hf.vocab_size,
                        options.get("max_model_len") or hf.max_position_embeddings,
                        grpc_address=f"127.0.0.1:{grpc[0]}" if grpc else None, grpc_messages=pb,
                        app_name=SERVED_MODEL_NAME, kv_holdings=kv_holdings, num_groups=num_groups)
        soak = _run(target, cfg, show_progress)
    sample = soak.check_sample()
    log_progress("soak", show_progress, f"checking {len(sample)} outputs against the offline engine")
    wrong = count_wrong_outputs(model_dir, sample, {k: v for k, v in options.items() if k not in (
        "model", "num_replicas", "tensor_parallel_size", "step_timeout_s")})
    return {**figures, "url": target.url, "model": model_dir, "num_groups": num_groups,
            "tensor_parallel_size": tensor_parallel_size, **soak.figures(wrong, len(sample))}


def _groups_hurt(before: dict[str, tuple[bool, int]] | None, after: dict[str, tuple[bool, int]] | None) -> int | None:
    """Groups that were serving before and, after, are gone, unhealthy or rebuilt."""
    if before is None or after is None:
        return None
    return sum(1 for gid, (healthy, rebuilds) in before.items()
               if healthy and (gid not in after or not after[gid][0] or after[gid][1] > rebuilds))


def _run(target: Target, cfg: SoakConfig, show_progress: bool) -> Soak:
    soak = Soak(target, cfg, show_progress)
    asyncio.run(soak.run())
    return soak

