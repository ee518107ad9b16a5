"""Triton's interpreter, without its repeated re-patching of `triton.language` (test speed only).

A kernel launch (`GridExecutor.__call__`) patches `triton.language`'s builtins for the interpreter and restores them
when the launch ends. Every call of a `@triton.jit` helper inside the kernel (`InterpretedFunction.__call__`) patches
them again, although they are already patched: `inspect.getmembers` over `tl`, `tl.tensor` and `tl.math`, per
call, per program (and `tl.core` for each of `triton.language.standard`'s, `tl.max`, `tl.zeros`, ...). Here a
helper called during a launch skips the patch when the launch has patched its modules already (the launch's own
patch, or an earlier helper's: Triton never restores those); anything else is patched as Triton does. What the
kernels compute is untouched. tests/kernels/test_triton_attention.py's `test_attention_matches_reference`, 84 cases
on one core: 101 -> 69 s.
"""

from __future__ import annotations

import functools
import inspect
import threading

_state = threading.local()  # per thread: whether a launch is running, and the language modules patched in it


@functools.cache  # (a function's module globals hold the same modules for good)
def _languages(fn) -> frozenset[int]:
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def install() -> None:
    """Patch Triton's interpreter once per process: Triton 3.9's, whose internals these are (others run as they
    come)."""
    import triton
    from triton.runtime import interpreter

    if getattr(interpreter, "_hf_fp8kv_fast", False) or not triton.__version__.startswith("3.9."):
        return
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__

    def patch_lang_once(fn):
        covered = getattr(_state, "covered", None)
        if covered is not None and _languages(fn) <= covered:
            return interpreter._LangPatchScope()  # already patched by the running launch: nothing to restore
        scope = patch_lang(fn)
        if getattr(_state, "launching", False):  # (a helper's own patch is never restored: it holds too)
            _state.covered = (covered or frozenset()) | _languages(fn)
        return scope

    def launch_with_one_patch(self, *args, **kwargs):
        _state.launching, _state.covered = True, None
        try:
            return launch(self, *args, **kwargs)
        finally:
            _state.launching, _state.covered = False, None

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = launch_with_one_patch
    interpreter._hf_fp8kv_fast = True
