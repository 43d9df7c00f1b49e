"""The Triton interpreter without its repatching on every device-function call (the interpreter
pass only: conftest installs it when TRITON_INTERPRET=1).

triton's interpreter patches triton.language (its builtins, tensor methods, reductions) when a
kernel launches (GridExecutor) and restores it when the kernel ends. A call of a @triton.jit
helper from inside the kernel (InterpretedFunction.__call__) patches the same modules again:
`inspect.getmembers` over tl, tl.tensor and tl.math each time, about 2 ms a call, for a
patch that changes nothing (the members were patched when the kernel launched; a patched
member is no longer a builtin, so `_patch_builtin` finds none, and the rest reinstalls
equivalent functions). Our kernels call small helpers in their loops: the router's interpreter
tests ran a fifth faster without it.

`install()` wraps `_patch_lang` so a call made while a kernel runs, for a helper that sees no
language module the kernel's own patch (or an earlier helper's in the same kernel) did not
cover, returns an empty scope. Anything else patches as before: the kernel's own patch, the
first call of a helper that sees triton.language.core where the kernel did not (triton's
standard library), a helper called outside a kernel, a helper that sees no language module at
all (which triton refuses). Installed only under the triton releases whose interpreter this was
checked against (CHECKED); under another nothing is installed and the pass runs as before, only
slower: ops/test_interpreter_device_calls.py fails then, so the wrapper gets checked again. One
kernel at a time, in one thread, as triton's own patching of the shared modules assumes.
"""

from __future__ import annotations

import inspect
import weakref

STATS = {"skipped": 0}  # helper calls whose patch was skipped (the test reads it)
CHECKED = ("3.7.1",)  # the pinned triton (Makefile's TRITON), whose interpreter this follows


# fn -> _language_modules(fn). It assumes what a module imports of triton.language does not change
# after its first kernel or helper call (imports at the top); weak, so kernels defined in a test go.
_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _language_modules(fn) -> frozenset[int]:
    """The triton.language modules `fn` sees among its globals, which `_patch_lang` patches: read
    once a function, not at every helper call."""
    modules = _MODULES.get(fn)
    if modules is None:
        import triton.language as tl

        found = (v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        modules = _MODULES[fn] = frozenset(id(v) for v in found)
    return modules


def pinned_interpreter(names):
    """triton's interpreter module where triton is the release these patches were checked against
    (CHECKED) and the module has every one of `names`; else None (nothing gets patched)."""
    try:
        import triton
        from triton.runtime import interpreter
    except ImportError:
        return None
    if triton.__version__ not in CHECKED or not all(hasattr(interpreter, n) for n in names):
        return None
    return interpreter


def install() -> bool:
    """Installs the wrapper into triton's interpreter; False (and nothing changed) where its
    internals are not the ones this was written against."""
    interpreter = pinned_interpreter(("_patch_lang", "_LangPatchScope", "GridExecutor"))
    if interpreter is None:
        return False
    if getattr(interpreter, "_moe_kernels_installed", False):
        return True
    original_patch = interpreter._patch_lang
    original_launch = interpreter.GridExecutor.__call__
    running: list[dict] = []  # the kernels being interpreted (one at a time): what their patch covered

    def patch_lang(fn):
        modules = _language_modules(fn)
        if running and running[-1]["patched"] and modules and modules <= running[-1]["modules"]:
            STATS["skipped"] += 1
            return interpreter._LangPatchScope()
        scope = original_patch(fn)
        if running:
            if fn is running[-1]["kernel"]:
                # The launch's own patch (GridExecutor's, after its pre-run hooks, before the
                # grid runs), which it restores when the kernel ends: never skipped.
                running[-1]["patched"] = True
            # A helper's patch that covered another module (triton's standard library sees
            # tl.core): nothing restores it before the kernel ends, so it holds from here on.
            running[-1]["modules"] |= modules
        return scope

    def launch(self, *args, **kwargs):
        running.append({"kernel": self.fn, "modules": _language_modules(self.fn), "patched": False})
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            running.pop()

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch
    interpreter._moe_kernels_installed = True
    return True
