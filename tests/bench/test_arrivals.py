"""The arrivals benchmark's run: decoders at once, then a prompt every few steps (CPU: the
figures themselves need captured mixed-step graphs, so they are null here)."""

from __future__ import annotations

from tandem.bench.arrivals import FIGURES, arrival_figures, arrival_run
from tandem.bench.workload import fixed_length_requests
from tandem.workers.llm import LLM
from tests.conftest import tiny_model


def test_arrivals_come_every_few_steps_and_every_request_finishes() -> None:
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", max_num_seqs=8, block_size=4)
    decoders = fixed_length_requests(2, 8, 6, 512, seed=3)
    arrivals = fixed_length_requests(3, 12, 2, 512, seed=4)
    seconds, steps = arrival_run(llm, decoders, arrivals, every=2)
    # Step 0 prefills the decoders and the first arrival; arrivals join before steps 2 and 4
    # (each prefilled in that step, its 2 tokens done the step after); the decoders' 6 tokens
    # take steps 0-5.
    assert steps == 6 and seconds > 0
    assert not llm.engine.has_unfinished_requests()
    llm.engine.pool.check_all_free()
    assert arrival_figures(llm, 512, repeats=1) == dict.fromkeys(FIGURES)  # no mixed-step graphs on CPU
    llm.shutdown()
