"""The channel-transport benchmark's pieces that need no Ray: the flush it sends is a real
channel batch of the size it reports, and a process's CPU is read from /proc."""

from __future__ import annotations

import hashlib
import os
import time

from tandem.bench.channel_transports import _batch, _cpu_s
from tandem.workers.serving.messages import decode_batch


def test_the_flush_is_a_real_batch_of_one_token_deltas() -> None:
    batch = decode_batch(_batch(128))
    assert len(batch.deltas) == 128 and not batch.closing
    assert {tuple(d.outputs[0].token_ids) for d in batch.deltas} == {(1234,)}
    assert len({d.request_id for d in batch.deltas}) == 128


def test_a_process_cpu_time_is_what_its_clock_says() -> None:
    before, clock = _cpu_s(os.getpid()), time.process_time()
    hashlib.sha256(bytes(64 << 20)).digest()  # work: tens of ms of CPU
    used = time.process_time() - clock
    assert used > 0.02
    assert abs((_cpu_s(os.getpid()) - before) - used) <= 0.03  # /proc counts in 10 ms ticks, read twice
