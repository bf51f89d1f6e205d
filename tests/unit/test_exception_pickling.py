"""Exceptions that cross a process boundary re-create themselves from pickle.

Ray pickles what a task or actor method raises (Serve's gRPC proxy unpickles what an
ingress method raised); one whose `__init__` wants more than its `args` hold cannot be
re-created there, and the caller gets Ray's UnserializableException instead of its status.
"""

from __future__ import annotations

import pickle

import grpc
import pytest

from tandem.cluster.placement import PlacementError
from tandem.router.admission import NoGroupUp, Overloaded
from tandem.router.engine_client import RequestTimeout, ServiceUnavailable, _GroupFailed
from tandem.router.grpc_service import RpcError
from tandem.workers.engine.engine_dead import EngineDeadError
from tandem.workers.executor.ray_executor import GroupFailedError

CASES = [
    (NoGroupUp("no replica group is running", 3), {"message": "no replica group is running", "retry_after_s": 3}),
    (Overloaded("4 requests in flight", 2), {"message": "4 requests in flight", "retry_after_s": 2}),
    (RpcError(grpc.StatusCode.UNAVAILABLE, "busy"), {"code": grpc.StatusCode.UNAVAILABLE, "details": "busy"}),
    (_GroupFailed("worker died", "g1"), {"group_id": "g1"}),
    (ServiceUnavailable("the replica group failed"), {}),
    (RequestTimeout("past 2 s"), {}),
    (GroupFailedError("worker pp_rank=0 tp_rank=1 died"), {}),
    (EngineDeadError("the group failed"), {}),
    (PlacementError("no node has 2 GPUs"), {}),
]


@pytest.mark.parametrize("exc, attributes", CASES, ids=[type(exc).__name__ for exc, _ in CASES])
def test_round_trip_keeps_type_message_and_attributes(exc: Exception, attributes: dict) -> None:
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is type(exc) and str(again) == str(exc)
    assert {name: getattr(again, name) for name in attributes} == attributes


def test_no_group_up_is_still_a_service_unavailable() -> None:
    again = pickle.loads(pickle.dumps(NoGroupUp("no replica group is running", 3)))
    assert isinstance(again, ServiceUnavailable) and str(again) == "no replica group is running"
