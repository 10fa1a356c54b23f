"""Triton launches that skip the binder once a specialization has compiled: ``launch(kernel, grid, *args, **meta)``.

``kernel[grid](...)`` (``JITFunction.run``) binds and specializes every argument, builds and looks up a cache key
and a launch-metadata dict on each call: ~100 us of host time a launch on an H100 host, as long as the GPU takes
for an eager forward of a small decoder. :func:`launch` keys a call on what Triton 3.6's binder specializes on
(tensors: dtype and 16-byte aligned start; ints: == 1, % 16 == 0, i32/i64/u64 range; bools, floats, None; tensor
descriptors: dtype, block shape, layout; constexpr values and options; the current device and debug knobs). The
first call of a key goes through Triton (which compiles and caches as usual) and the CompiledKernel it returns is
kept; later calls of the key call its launcher as ``JITFunction.run`` ends, on the current stream of that call.

Triton's own path serves: triton versions whose internals this was not checked against (3.6 and 3.9 were), the
interpreter, machines without CUDA, ``RERANKIT_DIRECT_LAUNCH=0`` (read on each call), launch hooks (profilers),
pre-run hooks, arguments of a type the key does not know, and a kernel whose internals did not have the shape
expected (one warning on ``rerankit.engine``). Not checked on the direct path: Triton's check that the globals a
kernel read have not changed since it compiled.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
from typing import Any, Callable

import torch

try:
    import triton
    from triton import knobs
    from triton.runtime.jit import JITFunction
except ImportError:  # the kernels' references serve machines without triton
    triton = None
    JITFunction = None

ENV = "RERANKIT_DIRECT_LAUNCH"
VERIFIED = ("3.6.", "3.9.")  # triton releases whose run/binder/launcher this mirrors
MAX_KEYS = 256  # specializations kept a kernel; calls of others go through Triton

log = logging.getLogger("rerankit.engine")
_CONSTEXPR, _TYPE_ONLY, _NO_ALIGN, _FULL = range(4)  # how Triton's binder specializes a parameter
_CONSTANTS = (int, float, bool, str, type(None))  # constexpr values keyed by type and value
_I32, _I64, _U64 = 2**31, 2**63, 2**64
_HAS_FPSAN = triton is not None and hasattr(knobs.compilation_knobs, "fpsan_homomorphic_casts")  # 3.9's run


class Unsupported(Exception):
    """A call the key does not cover (argument type, call shape): it goes through Triton."""


def verified(version: str) -> bool:
    """Whether the direct path may run on this triton version."""
    return version.startswith(VERIFIED)


@functools.cache
def _getters() -> tuple[Callable[[], int], Callable[[int], int]]:
    """Triton's own current device and current (raw) stream getters, as ``JITFunction.run`` calls them."""
    from triton.runtime.driver import driver

    return driver.active.get_current_device, driver.active.get_current_stream


@functools.cache
def available() -> bool:
    """Whether direct launches can run in this process (a verified triton compiling for CUDA, no interpreter)."""
    if triton is None or os.environ.get("TRITON_INTERPRET") == "1" or knobs.runtime.interpret:
        return False
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return False
    if not verified(triton.__version__):
        log.warning("direct Triton launches are off: triton %s is not a version whose launch internals rerankit "
                    "checked (%s)", triton.__version__, ", ".join(v + "x" for v in VERIFIED))
        return False
    try:
        _getters()
    except Exception as error:  # a driver of another shape
        _off("direct Triton launches are", error)
        return False
    return True


def _off(what: str, error: BaseException) -> None:
    log.warning("%s off (triton %s): %s: %s", what, triton.__version__, type(error).__name__, error)


def _quiet(hook: Any) -> bool:
    """Whether a launch hook calls nothing: None, or an empty HookChain (Triton's default)."""
    return hook is None or (type(hook) is knobs.HookChain and not hook.calls)


def _hooks_quiet() -> bool:
    """No launch hook (a profiler's) and no pipeline-inspection hook (3.9 keys kernels on it) is set."""
    runtime = knobs.runtime
    return _quiet(runtime.launch_enter_hook) and _quiet(runtime.launch_exit_hook) \
        and getattr(runtime, "add_stages_inspection_hook", None) is None


_LAYOUTS: dict[int, tuple[Any, str]] = {}  # id(layout) -> (the layout, its repr)


def _layout_key(layout: Any) -> str:
    """``repr(layout)``, what Triton keys a Gluon descriptor's layout on, computed once per layout object."""
    hit = _LAYOUTS.get(id(layout))
    if hit is None or hit[0] is not layout:
        if len(_LAYOUTS) >= 64:
            _LAYOUTS.clear()
        hit = _LAYOUTS[id(layout)] = (layout, repr(layout))  # holding the layout keeps its id its own
    return hit[1]


@functools.cache
def _descriptor_types() -> tuple[type | None, type | None]:
    """Triton's TensorDescriptor and Gluon's Hopper TensorDescriptor, where this triton has them."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        TensorDescriptor = None
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    except ImportError:
        GluonDescriptor = None
    return TensorDescriptor, GluonDescriptor


def arg_key(value: Any, mode: int) -> Any:
    """What Triton specializes argument ``value`` on, as a hashable (equal keys: one compiled kernel)."""
    kind = type(value)
    if mode == _CONSTEXPR:
        if kind in _CONSTANTS:
            return kind, value  # by type too: Triton keys on str(value) (1, 1.0 and True are apart)
        raise Unsupported(kind.__name__)
    if kind is int:
        if mode != _TYPE_ONLY and value == 1:
            return "one"  # Triton passes 1 as a constexpr
        width = 0 if -_I32 <= value < _I32 else 1 if -_I64 <= value < _I64 else 2 if 0 <= value < _U64 else 3
        return width + 4 * (mode == _FULL and value & 15 == 0)
    if kind is bool:
        return "u1"
    if kind is float:
        return "fp32"
    if value is None:
        return "none"
    if isinstance(value, torch.Tensor):
        return value.dtype if mode != _FULL else (value.dtype, value.data_ptr() & 15 == 0)
    triton_desc, gluon_desc = _descriptor_types()
    if kind is triton_desc or kind is gluon_desc:
        return (kind, value.base.dtype, tuple(value.block_shape), value.padding,
                getattr(value, "round_f32_to_tf32", False),
                _layout_key(value.layout) if kind is gluon_desc else None)
    raise Unsupported(kind.__name__)


class _Kernel:
    """A JITFunction's parameters as its binder treats them, and its compiled kernels by key."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.direct = True
        parameters = list(fn.signature.parameters.values())
        if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters):
            raise Unsupported("a parameter that is not positional-or-keyword")
        self.names = tuple(p.name for p in parameters)
        self.defaults = tuple(p.default for p in parameters)
        self.modes = tuple(_mode(kp) for kp in fn.params)
        self.shapes: dict[tuple, tuple] = {}  # (positional count, keyword names) -> where each value comes from
        self.entries: dict[tuple, tuple] = {}  # key -> (CompiledKernel, launcher, function, packed metadata)

    def shape(self, count: int, keywords: tuple[str, ...]) -> tuple[tuple, tuple]:
        """For a call of ``count`` positional arguments and these keywords: each later parameter's source (a
        keyword's name, or its default) and the keywords that are options (num_warps, ...)."""
        if count > len(self.names) or any(name in self.names[:count] for name in keywords):
            raise Unsupported("call shape")  # Triton raises the TypeError
        tail = []
        for name, default in zip(self.names[count:], self.defaults[count:]):
            if name not in keywords and default is inspect.Parameter.empty:
                raise Unsupported(f"no value for {name}")
            tail.append((True, name) if name in keywords else (False, default))
        return tuple(tail), tuple(name for name in keywords if name not in self.names)

    def bind(self, args: tuple, kwargs: dict, device: int) -> tuple[tuple, tuple]:
        """The call's values of every parameter, in order, and its key."""
        call = (len(args), *kwargs)
        shape = self.shapes.get(call)
        if shape is None:
            shape = self.shapes[call] = self.shape(len(args), call[1:])
        tail, options = shape
        values = (*args, *[kwargs[source] if keyword else source for keyword, source in tail])
        key = (call, device, _run_options(), *map(arg_key, values, self.modes),
               *[arg_key(kwargs[name], _CONSTEXPR) for name in options])
        return values, key

    def keep(self, key: tuple, compiled: Any) -> None:
        """Keep what Triton launched ``key`` with; on internals of another shape, leave the kernel to Triton."""
        if compiled is None or len(self.entries) >= MAX_KEYS:
            return  # None: a jit_cache_hook skipped the launch
        try:
            entry = (compiled, compiled.run, compiled.function, compiled.packed_metadata)
            if not callable(entry[1]) or entry[2] is None:
                raise AttributeError("the compiled kernel has no launcher or function")
        except Exception as error:  # any surprise: Triton's path from now on
            self.direct = False
            _off(f"direct launches of {self.fn} are", error)
            return
        self.entries[key] = entry


def _run_options() -> tuple:
    """The knobs ``JITFunction.run`` adds to a call's options (so to its cache key): debug, instrumentation mode,
    and on 3.9 the FP sanitizer's casts."""
    compilation = knobs.compilation
    return (knobs.runtime.debug, compilation.instrumentation_mode,
            compilation.fpsan_homomorphic_casts if _HAS_FPSAN else None)


def _mode(param: Any) -> int:
    """How Triton 3.6's ``create_function_from_signature`` specializes this KernelParam."""
    if param.is_constexpr:
        return _CONSTEXPR
    annotation = param.annotation_type
    if param.do_not_specialize or annotation == "u1" or annotation[:2] in ("fp", "bf"):
        return _TYPE_ONLY
    return _NO_ALIGN if param.do_not_specialize_on_alignment else _FULL


_KERNELS: dict[int, _Kernel] = {}  # id(JITFunction) -> its entry (which holds it, so the id stays its own)


def _kernel_of(kernel: Any) -> _Kernel | None:
    """The entry of ``kernel``, made at its first launch; None where Triton's path takes all its calls."""
    found = _KERNELS.get(id(kernel))
    if found is not None or JITFunction is None or not isinstance(kernel, JITFunction) or not available():
        return found
    try:
        found = _Kernel(kernel)
    except Exception as error:  # Unsupported, or Triton's KernelParam of another shape
        if not isinstance(error, Unsupported):
            _off(f"direct launches of {kernel} are", error)
        found = _Kernel.__new__(_Kernel)
        found.fn, found.direct = kernel, False
    _KERNELS[id(kernel)] = found
    return found


def launch(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> Any:
    """``kernel[grid](*args, **kwargs)``: through Triton the first time for a specialization, then straight to the
    compiled kernel's launcher (see the module's docstring). Returns the CompiledKernel, as Triton does."""
    entry = _kernel_of(kernel)
    if entry is None or not entry.direct or kernel.pre_run_hooks or not _direct_on():
        return _through_triton(kernel, grid, args, kwargs)
    current_device, current_stream = _getters()
    device = current_device()
    try:
        values, key = entry.bind(args, kwargs, device)
        kept = entry.entries.get(key)
    except (Unsupported, TypeError):  # TypeError: an unhashable option
        return _through_triton(kernel, grid, args, kwargs)
    if kept is None:
        compiled = _through_triton(kernel, grid, args, kwargs)
        entry.keep(key, compiled)
        return compiled
    compiled, run, function, metadata = kept
    if callable(grid):
        grid = grid(dict(zip(entry.names, values)))
    size = len(grid)
    grid = (grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1)
    run(*grid, current_stream(device), function, metadata, None, None, None, *values)  # no launch metadata or
    # hooks: none are set (_hooks_quiet)
    recorder = getattr(_RECORDING, "recorder", None)
    if recorder is not None:
        recorder.append(Recorded(entry, run, function, metadata, grid, values, device))
    return compiled


def _through_triton(kernel: Any, grid: Any, args: tuple, kwargs: dict) -> Any:
    """Triton's own launch; a recording under way (``recording``) can then not replay the step it is in."""
    note_launch_elsewhere()
    return kernel[grid](*args, **kwargs)


# Replaying launches: a step whose launches all went the direct way can launch them again with some arguments
# replaced (``Recorded.replay``), skipping its wrapper and the binder (``engine.launch_replay``).
_RECORDING = threading.local()


def note_launch_elsewhere() -> None:
    """Tell a recording under way that a Triton kernel was launched other than by :func:`launch` (an autotuner's
    first call): the step cannot be replayed."""
    recorder = getattr(_RECORDING, "recorder", None)
    if recorder is not None:
        recorder.append(None)


class recording:
    """``with recording() as launches:`` collects this thread's :func:`launch` calls, a :class:`Recorded` each (None
    for one that went through Triton's own path)."""

    def __enter__(self) -> list:
        self.previous = getattr(_RECORDING, "recorder", None)
        _RECORDING.recorder = launches = []
        return launches

    def __exit__(self, *exc: Any) -> None:
        _RECORDING.recorder = self.previous


def replay_possible() -> bool:
    """Whether recorded launches may be replayed now: the direct path is on and no launch hook (a profiler) is set."""
    return available() and _direct_on()


def _direct_on() -> bool:
    """Neither ``RERANKIT_DIRECT_LAUNCH=0`` nor a launch hook (a profiler's) asks for Triton's own path."""
    return os.environ.get(ENV) != "0" and _hooks_quiet()


class Recorded:
    """One direct launch as it ran: its compiled kernel, grid and argument values (every parameter, in order)."""

    __slots__ = ("entry", "run", "function", "metadata", "grid", "values", "device")

    def __init__(self, entry: _Kernel, run: Callable, function: Any, metadata: Any, grid: tuple, values: tuple,
                 device: int) -> None:
        self.entry, self.run, self.function, self.metadata = entry, run, function, metadata
        self.grid, self.values, self.device = grid, values, device

    def specializes_alike(self, position: int, value: Any) -> bool:
        """Whether ``value`` in parameter ``position`` keys as the recorded one (so the compiled kernel takes it)."""
        mode = self.entry.modes[position]
        try:
            return mode != _CONSTEXPR and arg_key(value, mode) == arg_key(self.values[position], mode)
        except Unsupported:
            return False

    def replay(self, changes: dict[int, Any]) -> None:
        """Launch again on the current stream with the values at ``changes``' positions replaced; the caller checked
        each with :meth:`specializes_alike`."""
        values = list(self.values)
        for position, value in changes.items():
            values[position] = value
        self.run(*self.grid, _getters()[1](self.device), self.function, self.metadata, None, None, None, *values)

