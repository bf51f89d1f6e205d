"""OutputPace: how often a streamed request's news leaves the engine once its first token has.

A streamed request makes an output every step by default (delta mode): its new text, token
ids and logprobs. Every output costs what carries it on (the group's frame, the ingress's
decoding, its SSE chunk, the proxy) the same whatever it holds, so a request given a pace
makes one output per `interval_s`, at the step end nearest its time: a step that ends well
before it adds its tokens to what the request will say next, and the engine makes no
output for it at all (delta mode reads the text and tokens since the last output, so
nothing is joined or copied meanwhile). The first token goes out at once (time to first
token), and the last output, whenever it comes; an error or an abort too.

One pace is shared by the requests of one ingress channel (workers/serving/outbox.py), whose
group sets `interval_s` as streams come and go: the engine's thread reads it at every step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class OutputPace:
    interval_s: float = 0.0  # 0: an output every step
