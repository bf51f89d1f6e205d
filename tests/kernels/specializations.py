"""The variants Triton would compile, read under its interpreter (which compiles nothing).

Triton's JIT compiles a kernel once per specialisation key: the constexpr values, and for the
other arguments their type, whether an integer is 1 or a multiple of 16, and whether a pointer
is 16-byte aligned (unless the kernel says `do_not_specialize` / `do_not_specialize_on_alignment`).
A key first seen mid-run is a compile inside a request's latency (hundreds of ms on a GPU
host). `recorded_specializations` computes every launch's key with the JIT's own rules
(`native_specialize_impl`), so a test on CPU sees what a GPU would compile.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.interpreter import InterpretedFunction

# kernel name -> {(runtime key, constexpr key)}; the runtime key is what varies without a
# constexpr changing (values, alignment).
Seen = dict[str, set[tuple[tuple, tuple]]]
# (kernel's module, kernel name, launch key): what `cuda_compile.py` needs to build the variant.
Launch = tuple[str, str, tuple[tuple, tuple]]


def launch_key(kernel: InterpretedFunction, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, tuple]:
    """(runtime key, constexpr key) of one launch, as `JITFunction.run` would compute it."""
    sig = inspect.signature(kernel.fn)
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters}).arguments
    no_value = set(kernel.kwargs.get("do_not_specialize") or ())
    no_align = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    runtime, constexprs = [], []
    for name, param in sig.parameters.items():
        if name not in bound:
            continue
        value = bound[name]
        if param.annotation in (tl.constexpr, "tl.constexpr"):
            constexprs.append((name, str(value) if isinstance(value, torch.dtype) else value))
        elif isinstance(value, float):  # never specialised on
            runtime.append((name, "fp32", None))
        else:
            runtime.append((name, *native_specialize_impl(BaseBackend, value, False, name not in no_value,
                                                          name not in no_align)))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in sig.parameters))  # num_warps, ...
    return tuple(runtime), tuple(constexprs) + options


@contextmanager
def recorded_specializations(launches: set[Launch] | None = None) -> Iterator[Seen]:
    """Every interpreted kernel launch inside the block, by kernel: the keys it was launched with
    (and, into `launches`, each with its kernel's module)."""
    seen: Seen = defaultdict(set)
    run = InterpretedFunction.run

    def recording_run(self: InterpretedFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        key = launch_key(self, args, kwargs)
        seen[self.fn.__name__].add(key)
        if launches is not None:
            launches.add((self.fn.__module__, self.fn.__name__, key))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        yield seen
    finally:
        InterpretedFunction.run = run
