"""`tandem bench soak --quick` end to end through the `tandem` entry point: its own Ray and
Serve (one TP=2 group of the demo model, HTTP and gRPC), overload, the KV allocator killed
and a TP worker SIGKILLed while the load runs. Nothing may be lost or leaked."""

from __future__ import annotations

from pathlib import Path

from tandem.bench.soak_client import OUTCOMES
from tests.bench.conftest import bench


def test_soak_quick(tmp_path: Path) -> None:
    fig = bench(tmp_path, "soak", "--quick")
    assert (fig["lost"], fig["unexpected_5xx"], fig["leaked_kv_blocks"]) == (0, 0, 0)
    assert fig["invalid_accepted"] == 0  # every bad request got its 4xx (gRPC INVALID_ARGUMENT / NOT_FOUND)
    assert fig["sent"] == sum(fig[kind] for kind in OUTCOMES)
    assert fig["invalid_answered"] > 0 and fig["abandoned"] > 0 and fig["completed"] > 0
    assert (fig["faults"], fig["num_groups"], fig["tensor_parallel_size"]) == ("allocator,worker", 1, 2)
    assert "fault_worker_error" not in fig and "fault_allocator_error" not in fig  # both were injected
    # Recovery times are figures, not asserted (no timing in tests): a busy machine stretches them.
    assert fig["wrong_output_checked"] == 6 and fig["wrong_output"] == 0
    assert fig["drained_requests_in_flight"] == 0
    assert fig["overload_goodput_ratio"] == fig["goodput_overload_req_s"] / fig["goodput_capacity_req_s"]
