"""The channel-transport benchmark's piece that needs no Ray: the flush it sends is a real
channel batch."""

from __future__ import annotations

from tandem.bench.channel_transports import _batch
from tandem.workers.serving.messages import decode_batch


def test_the_flush_is_a_real_batch_of_one_token_deltas() -> None:
    batch = decode_batch(_batch(128))
    assert len(batch.deltas) == 128 and not batch.closing
    assert {tuple(d.outputs[0].token_ids) for d in batch.deltas} == {(1234,)}
    assert len({d.request_id for d in batch.deltas}) == 128
