"""Triton's interpreter without its per-call re-patching of `triton.language`.

Under TRITON_INTERPRET=1 every call of a `@triton.jit` helper from inside a kernel patches
`triton.language` again (`_patch_lang`: `inspect.getmembers` over `tl`, `tl.tensor` and
`tl.math`), although the launch that runs the kernel patched those same modules and keeps
them patched until it ends. The kernels call helpers per tile, so the repeats are a large
share of some interpreted engine tests' time (bench/RESULTS.md). Here a helper called inside a launch whose patch
already covers the language modules the helper sees runs without patching again; anything
else (a helper that sees a module the launch did not patch, a call outside a launch, a
Triton whose interpreter is built differently) takes Triton's own path. What a kernel
computes does not change: the same rewritten function runs against the same patched modules.
"""

from __future__ import annotations

import inspect
from typing import Any

_applied = False
# Ids of the language modules the running launch has patched (None outside a launch).
_launch_langs: frozenset[int] | None = None
# fn -> (len of its globals when computed, ids of the language modules in them). A module's
# globals only grow (the interpreter adds its own names at a function's first rewrite), so
# their length tells a stale entry.
_langs_cache: dict[Any, tuple[int, frozenset[int]]] = {}
calls_skipped = 0  # helper calls that ran without re-patching (tests read it)


def _lang_ids(fn: Any, langs: tuple[Any, ...]) -> frozenset[int]:
    """The language modules in fn's globals, as Triton's `_patch_lang` finds them."""
    globals_ = fn.__globals__
    cached = _langs_cache.get(fn)
    if cached is not None and cached[0] == len(globals_):
        return cached[1]
    ids = frozenset(id(value) for value in list(globals_.values())
                    if inspect.ismodule(value) and any(value is lang for lang in langs))
    _langs_cache[fn] = (len(globals_), ids)
    return ids


def skip_repatching_in_helpers() -> bool:
    """Install the shortcut (once); False where this Triton's interpreter lacks the parts it wraps."""
    global _applied
    if _applied:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    grid_executor = getattr(interpreter, "GridExecutor", None)
    function = getattr(interpreter, "InterpretedFunction", None)
    error = getattr(interpreter, "InterpreterError", None)
    if (grid_executor is None or function is None or error is None or not hasattr(interpreter, "_patch_lang")
            or not hasattr(function, "rewrite")):
        return False
    langs = (tl, tl.core)
    launch = grid_executor.__call__
    helper_call = function.__call__

    def launch_call(self, *args, **kwargs):
        global _launch_langs
        outer = _launch_langs
        _launch_langs = _lang_ids(self.fn, langs)
        try:
            return launch(self, *args, **kwargs)
        finally:
            _launch_langs = outer

    def helper(self, *args, **kwargs):
        global calls_skipped
        if _launch_langs is None or not _lang_ids(self.fn, langs) <= _launch_langs:
            return helper_call(self, *args, **kwargs)
        calls_skipped += 1
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as Triton's own helper call reports it
            raise error(repr(e)) from e

    grid_executor.__call__ = launch_call
    function.__call__ = helper
    _applied = True
    return True
