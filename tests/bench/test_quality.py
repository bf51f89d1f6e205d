"""`tandem bench quality`: the metrics on hand-made distributions; the command end to end."""

from __future__ import annotations

import json
import math

import pytest

from tandem.bench.quality import QualitySet, compare, position_kl, quality_prompts, top1
from tandem.cli.main import main
from tandem.workers.core.request import Logprob, PositionLogprobs
from tests.bench.conftest import bench


def entry(probs: dict[int, float]) -> PositionLogprobs:
    """A position's logprobs from token -> probability, ranked by probability."""
    ranked = sorted(probs, key=lambda t: -probs[t])
    return {t: Logprob(math.log(probs[t]), ranked.index(t) + 1) for t in probs}


def test_identical_distributions_agree_with_zero_kl() -> None:
    a = entry({5: 0.5, 7: 0.25, 9: 0.125})
    b = entry({3: 0.9, 4: 0.05})
    figures = compare([[None, a, b]], [[None, dict(a), dict(b)]])
    assert figures == {"positions": 2, "top1_agreement": 1.0, "mean_kl": 0.0, "max_kl": 0.0}


def test_a_shifted_pair_has_the_kl_computed_by_hand() -> None:
    # Both report tokens 1 and 2; each side's rest is 0.25.
    # KL = 0.5 ln(0.5 / 0.25) + 0.25 ln(0.25 / 0.5) + 0.25 ln(0.25 / 0.25) = 0.25 ln 2
    ref, quant = entry({1: 0.5, 2: 0.25}), entry({1: 0.25, 2: 0.5})
    assert position_kl(ref, quant) == pytest.approx(0.25 * math.log(2), rel=1e-12)
    assert top1(ref) == 1 and top1(quant) == 2
    figures = compare([[None, ref, ref]], [[None, quant, ref]])
    assert figures["positions"] == 2 and figures["top1_agreement"] == 0.5
    assert figures["mean_kl"] == pytest.approx(0.125 * math.log(2), rel=1e-12)
    assert figures["max_kl"] == pytest.approx(0.25 * math.log(2), rel=1e-12)


def test_a_token_only_one_side_reports_goes_to_the_rest_bin() -> None:
    # Shared: token 1 only. Reference rest 0.5 (tokens 2 and the rest), quantized rest 0.75.
    ref, quant = entry({1: 0.5, 2: 0.3}), entry({1: 0.25, 3: 0.5})
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert position_kl(ref, quant) == pytest.approx(expected, rel=1e-12)


def test_ties_pick_the_smallest_token_id() -> None:
    assert top1(entry({8: 0.25, 3: 0.25, 1: 0.125})) == 3


def test_the_prompt_set_is_fixed_and_leaves_out_special_tokens() -> None:
    qset = QualitySet(num_prompts=3, prompt_len=5, seed=1)
    prompts = quality_prompts(qset, 10, excluded=(0, 1, 2))
    assert prompts == quality_prompts(qset, 10, excluded=(0, 1, 2))
    assert [len(p) for p in prompts] == [5, 5, 5]
    assert all(3 <= t < 10 for p in prompts for t in p)


def test_the_command_compares_the_reference_with_itself_exactly(llama_dir, tmp_path) -> None:
    figures = bench(tmp_path, "quality", "--model", llama_dir, "--quantization", "none", "--quick",
                    "--num-prompts", "4", "--prompt-len", "24")
    assert figures["benchmark"] == "quality" and figures["quantization"] == "none"
    assert figures["prompts"] == "random ids" and "heldout_loss" not in figures
    assert figures["kv_cache_dtype"] == "auto" and figures["top_k"] == 20
    assert figures["num_prompts"] == 4 and figures["positions"] == 4 * 23
    assert figures["top1_agreement"] == 1.0 and figures["mean_kl"] == 0.0 and figures["max_kl"] == 0.0
    assert json.loads(figures["reference_options"]) == json.loads(figures["quantized_options"]) == {"dtype": "auto"}
    assert figures["wall_s"] > 0 and figures["reference_s"] > 0 and figures["quantized_s"] > 0


def test_the_command_needs_something_to_compare(llama_dir, capsys) -> None:
    assert main(["bench", "quality", "--model", llama_dir, "--quick"]) == 2
    assert "give --quantization and/or --kv-cache-dtype" in capsys.readouterr().err
