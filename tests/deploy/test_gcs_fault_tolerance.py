"""Head-node failure survived: Ray's GCS SIGKILLed and started again under a running tandem,
with GCS fault tolerance on a real redis-server (tests/deploy/gcs_outage.py sets it up).

Streams running when the GCS dies finish with all their tokens; completions sent while it is
down are served and /health stays 200, since Serve's data plane (HAProxy, the ingress replica,
the group's channel) does not go through the GCS; the GCS started again with the same
arguments recovers the cluster's tables from Redis, so the control plane finds the same
application and replicas, and new completions get the greedy text from before the kill, from
the same group.

The ingress asks Serve's controller for the groups' status (router/engine_client.py), and the
controller answers through the GCS: before that wait was bounded, /health hung from the first
second of an outage and every request from its tenth (`_HEALTH_MAX_AGE` TTLs) until the GCS
came back. tests/serve/test_status_without_controller.py holds that bound against a controller
that never answers; `python3 -m tests.deploy.gcs_outage` measures outages past those ten
seconds for bench/RESULTS.md (a second, 13-second kill here cost the suite 16 s).
"""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import wait_for
from tests.deploy.gcs_outage import (
    PROBE_PROMPT,
    PROBE_TOKENS,
    FtCluster,
    complete,
    ft_cluster,
    healthy,
    running_replicas,
    start_stream,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed "
                       "(Debian: apt-get install redis-server; .ci/run installs it)"),
]

STREAM_PROMPT = "a stream across the kill"
STREAM_TOKENS = 400  # 1-7 s of streaming here (three at once, by load); the kill comes within their first 0.2 s
NUM_STREAMS = 3


@pytest.fixture(scope="module")
def cluster() -> FtCluster:
    with ft_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def before(cluster: FtCluster) -> dict:
    """What the cluster answers before any kill: greedy texts, the serving group, the replicas."""
    stream_ref = complete(cluster, STREAM_PROMPT, STREAM_TOKENS, timeout_s=120)
    probe_ref = complete(cluster, PROBE_PROMPT, PROBE_TOKENS)
    assert (stream_ref.status, probe_ref.status) == (200, 200), (stream_ref, probe_ref)
    replicas = running_replicas(cluster)
    assert replicas is not None and replicas["status"] == "RUNNING", replicas
    assert [len(replicas[d]) for d in ("OpenAIIngress", "GroupServer")] == [1, 1], replicas
    return {"stream": stream_ref.text, "probe": probe_ref.text, "group": probe_ref.group, "replicas": replicas}


def test_streams_running_when_the_gcs_dies_finish_and_it_recovers_from_redis(cluster: FtCluster, before) -> None:
    # The GCS keeps the cluster's tables in our Redis, not in its memory alone.
    assert int(cluster.redis.command("DBSIZE").removeprefix(b":")) > 0

    streams = [start_stream(cluster, STREAM_PROMPT, STREAM_TOKENS) for _ in range(NUM_STREAMS)]
    assert wait_for(lambda: all(log.num_chunks for log, _ in streams), timeout_s=60), "streams did not start"
    killed = cluster.head.kill_gcs()
    assert cluster.head.gcs_pid() is None

    # While it is down: a new stream and a completion.
    during, during_thread = start_stream(cluster, PROBE_PROMPT, PROBE_TOKENS)
    reply = complete(cluster, PROBE_PROMPT, PROBE_TOKENS)
    for _, thread in [*streams, (during, during_thread)]:
        thread.join(timeout=120)  # a stream silent for 60 s has failed by then (read_stream)
    assert cluster.head.gcs_pid() is None  # all of it was served without a GCS

    # Every stream ends with [DONE] after its finish_reason (none hangs, none stops short), all
    # its tokens (the text from before the kill), and its end came after the kill: it streamed across it.
    assert [log.ending() for log, _ in streams] == ["finished"] * NUM_STREAMS
    assert [log.text == before["stream"] for log, _ in streams] == [True] * NUM_STREAMS
    assert all(log.events[-1][0] > killed for log, _ in streams)
    assert (during.ending(), during.text) == ("finished", before["probe"])
    assert (reply.status, reply.text, reply.group) == (200, before["probe"], before["group"])
    # Readiness holds: a load balancer keeps sending (the groups' status is seconds old by now).
    assert healthy(cluster) and cluster.head.gcs_pid() is None

    cluster.head.restart_gcs()
    # The new GCS has the cluster's tables from Redis: the dashboard finds Serve's controller
    # (a detached actor) and it the same replicas; no group was replaced.
    assert wait_for(lambda: running_replicas(cluster, timeout_s=2.0) == before["replicas"], timeout_s=60,
                    interval_s=0.5), running_replicas(cluster)
    reply = complete(cluster, PROBE_PROMPT, PROBE_TOKENS)
    assert (reply.status, reply.text, reply.group) == (200, before["probe"], before["group"])
