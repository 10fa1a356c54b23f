"""Triton's CPU interpreter without the set-up it repeats on every helper call inside a kernel (test speed only).

Under TRITON_INTERPRET=1 a launch patches ``triton.language`` for the interpreter (``_patch_lang``) and puts it back
when the launch ends. Triton 3.x also redoes that patch each time the kernel calls a ``@triton.jit`` helper
(``InterpretedFunction.__call__``): a walk over every member of the language modules (``inspect.getmembers``)
that changes nothing, since the launch has patched those same modules already, and that took about 30% of
the interpreter's time in this suite (``tests/kernels/test_prefix_attention.py``: 44 s -> 31 s on the 2-core box).

Here a helper call skips the patch only while a launch runs on its thread and that launch patched every language
module the helper sees (``triton.language``, ``triton.language.core``); any other call patches as before (and
leaves its patch in place, as the stock call does). The kernels run the same interpreted code either way.
Installed only over the interpreter code this was written against (its source is compared): another triton runs
untouched. RERANKIT_TESTS_STOCK_INTERPRETER=1 turns it off.
"""

from __future__ import annotations

import inspect
import os
import textwrap
import threading

# InterpretedFunction.__call__ as triton 3.x ships it (3.9.0 checked): this module replaces exactly this.
STOCK_HELPER_CALL = '''
def __call__(self, *args, **kwargs):
    # This is a device function call
    _patch_lang(self.fn)
    fn = self.rewrite()
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise InterpreterError(repr(e)) from e
'''


def install() -> bool:
    """Install the shortcut; whether it is in place."""
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("RERANKIT_TESTS_STOCK_INTERPRETER") == "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    helper_call = getattr(getattr(interpreter, "InterpretedFunction", None), "__call__", None)
    launch = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    if getattr(helper_call, "skips_repeated_patch", False):
        return True
    try:
        helper_source = textwrap.dedent(inspect.getsource(helper_call)).strip()
        launch_source = inspect.getsource(launch)
    except (OSError, TypeError):
        return False
    if helper_source != STOCK_HELPER_CALL.strip() or "_patch_lang(self.fn)" not in launch_source \
            or "patch_scope.restore()" not in launch_source:
        return False

    state = threading.local()  # .patched: ids of the language modules the launch running on this thread patched

    def languages(fn) -> frozenset[int]:
        """The language modules ``_patch_lang(fn)`` patches: those ``fn``'s globals hold."""
        return frozenset(id(value) for value in fn.__globals__.values()
                         if inspect.ismodule(value) and value in [tl, tl.core])

    def launch_call(self, *args, **kwargs):
        outer = getattr(state, "patched", None)
        state.patched = languages(self.fn)  # the launch patches these before it runs the kernel, restores after
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.patched = outer

    def helper_call_once_patched(self, *args, **kwargs):
        # This is a device function call
        patched = getattr(state, "patched", None)
        needed = languages(self.fn)
        if patched is None or not needed <= patched:
            interpreter._patch_lang(self.fn)
            if patched is not None:
                state.patched = patched | needed
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    helper_call_once_patched.skips_repeated_patch = True
    interpreter.GridExecutor.__call__ = launch_call
    interpreter.InterpretedFunction.__call__ = helper_call_once_patched
    return True
