"""The tests' shortcut through Triton's interpreter (tests/triton_interpreter.py): a helper
called inside a launch runs without re-patching the language, and computes what it did."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tests import triton_interpreter  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")


@triton.jit
def _scaled(x, factor: tl.constexpr):
    return x * factor


@triton.jit
def _nested(x):
    return _scaled(x, 3) + 1


@triton.jit
def _kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, ROUNDS: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    for _ in range(ROUNDS):
        x = _nested(x)
    tl.store(out_ptr + offsets, x)


def test_helpers_inside_a_launch_skip_the_repatch_and_compute_the_same() -> None:
    assert triton_interpreter.skip_repatching_in_helpers()  # installed by tests/conftest.py
    x = torch.arange(12, dtype=torch.int32)
    out = torch.empty_like(x)
    before = triton_interpreter.calls_skipped
    _kernel[(3,)](x, out, BLOCK=4, ROUNDS=2)
    # Three programs, two rounds, two helpers a round (the nested one included).
    assert triton_interpreter.calls_skipped - before == 12
    assert out.tolist() == [(v * 3 + 1) * 3 + 1 for v in range(12)]
    assert triton_interpreter._launch_langs is None  # nothing left marked after the launch


@triton.jit
def _bad_helper(x):
    return x + tl.arange(0, 3)  # a range whose length is not a power of two: Triton refuses it


@triton.jit
def _bad_kernel(out_ptr):
    tl.store(out_ptr + tl.arange(0, 4), _bad_helper(tl.zeros([4], dtype=tl.int32)))


def test_a_failing_helper_still_reports_as_triton_does() -> None:
    from triton.runtime.interpreter import InterpreterError

    with pytest.raises(InterpreterError, match="power of 2"):
        _bad_kernel[(1,)](torch.empty(4, dtype=torch.int32))
    assert triton_interpreter._launch_langs is None
