"""The Triton interpreter without its repatching on every device-function call (the interpreter
pass only: conftest installs it when TRITON_INTERPRET=1).

triton's interpreter patches triton.language (its builtins, tensor methods, reductions) when a
kernel launches (GridExecutor) and restores it when the kernel ends. A call of a @triton.jit
helper from inside the kernel (InterpretedFunction.__call__) patches the same modules again:
`inspect.getmembers` over tl, tl.tensor and tl.math each time, about 2 ms a call, for a
patch that changes nothing (the members were patched when the kernel launched; a patched
member is no longer a builtin, so `_patch_builtin` finds none, and the rest reinstalls
equivalent functions). Our kernels call small helpers in their loops, so this was about a
quarter of the interpreter pass's time.

`install()` wraps `_patch_lang` so a call made while a kernel runs, for a helper that sees no
language module the kernel's own patch did not cover, returns an empty scope. Anything else
(the kernel's own patch, the first call of a helper that sees triton.language.core where the
kernel did not, as triton's standard library does; a helper called outside a kernel) patches as
before. If the interpreter's internals change
(another triton), nothing is installed and the pass runs as before, only slower:
ops/test_interpreter_device_calls.py fails then, so the change is noticed.
"""

from __future__ import annotations

import inspect

STATS = {"skipped": 0, "patched": 0}


def _language_modules(fn) -> frozenset[int]:
    """The triton.language modules `fn` sees among its globals, which `_patch_lang` patches."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def install() -> bool:
    """Installs the wrapper into triton's interpreter; False (and nothing changed) where its
    internals are not the ones this was written against."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    names = ("_patch_lang", "_LangPatchScope", "GridExecutor")
    if not all(hasattr(interpreter, n) for n in names) or getattr(interpreter, "_moe_kernels_installed", False):
        return getattr(interpreter, "_moe_kernels_installed", False)
    original_patch = interpreter._patch_lang
    original_launch = interpreter.GridExecutor.__call__
    running: list[dict] = []  # the kernels being interpreted (one at a time): what their patch covered

    def patch_lang(fn):
        if running and running[-1]["patched"] and _language_modules(fn) <= running[-1]["modules"]:
            STATS["skipped"] += 1
            return interpreter._LangPatchScope()
        scope = original_patch(fn)
        STATS["patched"] += 1
        if running:
            # The launch's own patch (GridExecutor calls it once, before the grid runs), or a
            # helper's that covered another module (triton's standard library sees tl.core):
            # nothing restores a helper's patch before the kernel ends, so it holds from here on.
            running[-1]["patched"] = True
            running[-1]["modules"] |= _language_modules(fn)
        return scope

    def launch(self, *args, **kwargs):
        running.append({"modules": _language_modules(self.fn), "patched": False})
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            running.pop()

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch
    interpreter._moe_kernels_installed = True
    return True
