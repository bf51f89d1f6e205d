"""`bench soak`: its request mix and outcome rules without a server, then `tandem bench soak
--quick` end to end through the `tandem` entry point: its own Ray and Serve (one TP=2 group
of the demo model, HTTP and gRPC), overload, the KV allocator killed and a TP worker
SIGKILLed while the load runs. Nothing may be lost or leaked."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from tandem.bench.preemption_tally import PreemptionTally
from tandem.bench.soak import SoakConfig
from tandem.bench.soak_client import OUTCOMES, _grpc_outcome, _http_error
from tandem.bench.soak_mix import MixSpec, SoakRequest, make_mix
from tests.bench.conftest import bench


def test_mix_is_seeded_and_has_its_shares() -> None:
    spec = MixSpec(num_prefixes=4, prefix_len=16)
    mix = make_mix(2000, spec, vocab_size=512, max_model_len=256, seed=3, grpc=True)
    assert mix == make_mix(2000, spec, vocab_size=512, max_model_len=256, seed=3, grpc=True)
    invalid = sum(1 for r in mix if r.invalid) / len(mix)
    abandon = sum(1 for r in mix if r.abandon_after) / len(mix)
    assert 0.08 < invalid < 0.12 and 0.18 < abandon < 0.22
    assert all(r.stream for r in mix if r.abandon_after)
    assert {r.api for r in mix} == {"http", "grpc"} and not any(r.chat for r in mix if r.api == "grpc")
    assert len({tuple(r.prompt_token_ids[:16]) for r in mix if not r.invalid}) == 4  # shared prefixes
    valid = make_mix(50, spec, vocab_size=512, max_model_len=256, seed=3, grpc=False, valid_only=True)
    assert all(r.checkable or r.chat for r in valid) and {r.api for r in valid} == {"http"}


def test_http_outcomes() -> None:
    valid, bad = SoakRequest(0, "http", False), SoakRequest(1, "http", False, invalid="top_p_zero")
    body = b'{"error": {"message": "m", "type": "t", "param": null, "code": null}}'
    failed = b'{"error": {"message": "service unavailable: the replica group failed: x", "type": "server_error"}}'
    assert _http_error(valid, 503, body) == ("rejected", "m")
    assert _http_error(valid, 429, body)[0] == "rejected"
    assert _http_error(valid, 503, failed)[0] == "failed_clean"
    assert _http_error(valid, 408, body)[0] == "failed_clean"
    assert _http_error(valid, 500, body)[0] == "unexpected_5xx"
    assert _http_error(bad, 400, body)[0] == "invalid_answered"
    assert _http_error(bad, 400, b"not json")[0] == "invalid_accepted"  # a 4xx, but not OpenAI-shaped
    assert _http_error(bad, 502, b"")[0] == "unexpected_5xx"


def test_grpc_outcomes() -> None:
    valid, bad = SoakRequest(0, "grpc", True), SoakRequest(1, "grpc", True, invalid="grpc_prompt_missing")
    code = grpc.StatusCode
    assert _grpc_outcome(valid, code.DEADLINE_EXCEEDED, "Deadline Exceeded", 0) == "lost"
    assert _grpc_outcome(valid, code.DEADLINE_EXCEEDED, "timeout: passed", 3) == "failed_clean"
    assert _grpc_outcome(valid, code.UNAVAILABLE, "overloaded", 0) == "rejected"
    assert _grpc_outcome(valid, code.UNAVAILABLE, "the replica group failed: x", 0) == "failed_clean"
    assert _grpc_outcome(valid, code.UNAVAILABLE, "x", 2) == "failed_clean"
    assert _grpc_outcome(valid, code.INTERNAL, "x", 0) == "unexpected_5xx"
    assert _grpc_outcome(bad, code.INVALID_ARGUMENT, "prompt: x", 0) == "invalid_answered"
    assert _grpc_outcome(bad, code.OK, "", 0) == "invalid_accepted"


def test_preemptions_of_rebuilt_and_replaced_engines_are_all_counted() -> None:
    tally = PreemptionTally()

    def report(**groups: tuple[int, int]) -> dict:  # group id -> (rebuilds, preemptions)
        return {"groups": {g: {"num_rebuilds": r, "num_preemptions": p} for g, (r, p) in groups.items()}}

    tally.read(report(a=(0, 3), b=(0, 1)))
    tally.read(report(a=(0, 5), b=(0, 1)))  # a's engine goes on: its highest count stands
    assert tally.total == 6
    tally.read(report(a=(1, 2), b=(0, 1)))  # a rebuilt in place: its first engine's 5 stay
    tally.read(report(c=(0, 4)))  # b's replica replaced by c: b's 1 stays
    assert tally.total == 5 + 2 + 1 + 4
    tally.read({"groups": {"c": {}}})  # a group that reports no figures adds nothing
    assert tally.total == 12


def test_config_checks_fault_names() -> None:
    with pytest.raises(ValueError, match="faults: unknown nope"):
        SoakConfig(faults=("worker", "nope"))


def test_strength_names_what_is_missing() -> None:
    from tandem.bench.soak_faults import FaultInjector

    injector = FaultInjector("app", holdings=None, probe=None, num_groups=2)
    healthy = {"healthy": True}
    report = {"groups": {"a": healthy, "b": healthy}, "unreachable_groups": 0,
              "allocator": {"present": True, "leases": {"a": 3, "b": 1}}}
    assert injector.short_of_strength(report, hit_group="c") == []
    report = {"groups": {"a": {"healthy": False}}, "unreachable_groups": 1,
              "allocator": {"present": True, "leases": {"b": 1}}}
    assert injector.short_of_strength(report, hit_group="a") == [
        "1 of 2 groups", "1 unreachable", "group a unhealthy", "group a (the one hit) still listed",
        "group a holds no allocator lease"]
    # A worker fault: the hit group may stay, once it serves on new workers.
    report = {"groups": {"a": {"healthy": True, "worker_pids": [7, 9]}, "b": healthy}, "unreachable_groups": 0,
              "allocator": {"present": True, "leases": {"a": 3, "b": 1}}}
    assert injector.short_of_strength(report, hit_group="a", old_workers={7, 8}) == [
        "group a (the one hit) still without new workers"]
    assert injector.short_of_strength(report, hit_group="a", old_workers={5, 6}) == []


@pytest.mark.slow
@pytest.mark.ray  # a server on Ray
def test_soak_quick(tmp_path: Path) -> None:
    fig = bench(tmp_path, "soak", "--quick")
    assert (fig["lost"], fig["unexpected_5xx"], fig["leaked_kv_blocks"]) == (0, 0, 0)
    assert fig["invalid_accepted"] == 0  # every bad request got its 4xx (gRPC INVALID_ARGUMENT / NOT_FOUND)
    assert fig["sent"] == sum(fig[kind] for kind in OUTCOMES)
    assert fig["invalid_answered"] > 0 and fig["abandoned"] > 0 and fig["completed"] > 0
    assert (fig["faults"], fig["num_groups"], fig["tensor_parallel_size"]) == ("allocator,worker,stall", 1, 2)
    assert not [k for k in fig if k.startswith("fault_") and k.endswith("_error")]  # all three were injected
    assert fig["step_timeout_s"] == 10.0  # the server the soak started finds a stalled step that fast
    # The hostile requests alone, first: each answered, no group failed, restarted or rebuilt.
    assert fig["groups_hurt_by_one_request"] == 0
    assert sum(fig.get(f"hostile_{kind}", 0) for kind in OUTCOMES) == 12 and "hostile_lost" not in fig
    # Recovery times are figures, not asserted (no timing in tests): a busy machine stretches them.
    assert fig["wrong_output_checked"] == 6 and fig["wrong_output"] == 0
    assert fig["drained_requests_in_flight"] == 0
    assert fig["overload_goodput_ratio"] == fig["goodput_overload_req_s"] / fig["goodput_capacity_req_s"]


def test_the_mix_fills_contexts_and_reads_slowly() -> None:
    """A share of prompts fills the context but for its own output (the soak's server sizes its KV
    cache so that they force preemptions), and a share of streamed clients reads slowly."""
    mix = make_mix(2000, MixSpec(num_prefixes=4, prefix_len=16), vocab_size=512, max_model_len=256, seed=3,
                   grpc=True)
    long = [r for r in mix if not r.invalid and len(r.prompt_token_ids) > 128]
    assert 0.01 < len(long) / len(mix) < 0.04
    assert all(248 <= len(r.prompt_token_ids) + r.max_tokens <= 256 and not r.chat and not r.abandon_after
               for r in long)
    slow = [r for r in mix if r.slow]
    assert 0.01 < len(slow) / len(mix) < 0.04
    assert all(r.stream and not r.abandon_after and not r.invalid for r in slow)


def test_the_mix_sends_what_hostile_clients_do() -> None:
    from tandem.bench.soak_mix import HOSTILE_INVALID, grpc_request, http_request
    from tandem.router import tandem_pb2 as pb

    spec = MixSpec(num_prefixes=4, prefix_len=16)
    mix = make_mix(2000, spec, vocab_size=512, max_model_len=256, seed=3, grpc=True)
    hostile = [r for r in mix if r.hostile]
    assert 0.07 < len(hostile) / len(mix) < 0.11 and all(not r.invalid for r in hostile)  # 0.9 x 0.10
    assert {r.invalid for r in mix if r.invalid} >= HOSTILE_INVALID  # every refusal is drawn
    http = next(r for r in hostile if r.api == "http" and not r.chat)
    assert http_request(http, "m", 40.0)[1]["temperature"] == 1e-40  # greedy on the server: still checked
    assert http.checkable
    ids = {grpc_request(r, pb, 40.0).request_id for r in hostile if r.api == "grpc"}
    assert ids == {"dup", "x#1"}
    n_huge = next(r for r in mix if r.invalid == "grpc_n_huge")
    assert grpc_request(n_huge, pb, 40.0).sampling.n == 2**32 - 1 and n_huge.is_hostile
