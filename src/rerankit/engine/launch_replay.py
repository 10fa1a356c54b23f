"""Replaying a decoder's per-layer kernel launches in an eager forward: the first layer runs each step, later
layers launch what it launched again, with their own weights.

An eager forward's host time is mostly the kernel wrappers' own Python (checks, output allocations, tensor
descriptors, the launch binder), paid again in every layer for the same shapes. Here the first layer runs each step
(an ``engine.models.fp8.Fp8Ops`` kernel wrapper, or the attention) while ``direct_launch.recording`` collects its
launches; a later layer's call of the same step launches them again (``direct_launch.Recorded.replay``) with the
arguments that differ replaced: a weight, a scale, a norm, or a tensor descriptor of one, each found in the
recorded launches by identity with the step's own arguments. The outputs land in the first layer's buffers, which the
step returns again: the layers run one after another on one stream, so a layer's writes follow the last reads of the
layer before.

A step is replayed only where that is exact. While it records:

* each of its Triton launches must have gone the direct way (``direct_launch.launch``; not an autotuner's first
  call, not Triton's own path);
* it may run no torch operation but allocations and views (a ``TorchDispatchMode`` watches): a copy, a conversion
  or a fill would not be replayed;
* a tensor it was given must reach its kernels as that tensor or as a descriptor of it; where a view of it does,
  later calls must give a tensor over the same memory (the first layer's own, still alive); its outputs must not
  share memory with its inputs.

A later call replays only if its arguments have the recorded structure, the same numbers and other objects, and
tensors of the same dtype, shape, strides and device, each specializing the compiled kernel as the recorded one did;
else it runs the step as usual. Never under graph capture (a graph records every launch once anyway) or where the
direct path is off.

Off unless ``RERANKIT_LAUNCH_REPLAY=1``: it cuts an eager forward's host time by a third, but whole W1 calls on an
H100 host ran 1-3 ms slower with it, at equal GPU-bound times, for a reason not yet found (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ENV = "RERANKIT_LAUNCH_REPLAY"
# What a recorded step may run besides its kernels and views of a tensor (which alias it, ``_aliases``):
# allocations, and the views that come as a list.
ALLOWED_OPS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "split",
                         "split_with_sizes", "unbind"})
_PRIMITIVES = (int, float, bool, str, type(None))
_MISS = object()


def enabled() -> bool:
    """Whether an eager forward may replay its layers' launches now."""
    if os.environ.get(ENV) != "1" or not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        return False
    from rerankit.kernels import direct_launch

    return direct_launch.replay_possible()


class _Watch(TorchDispatchMode):
    """The torch operations a step runs that are not allocations or views."""

    def __init__(self) -> None:
        super().__init__()
        self.other: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in ALLOWED_OPS and (func._schema.is_mutable or not _aliases(result, args)):
            self.other.append(name)  # (a view, or a conversion to its own dtype, aliases its argument: allowed)
        return result


def _aliases(result: Any, args: tuple) -> bool:
    """Whether an operation's result is a view of its first argument (no data read or written)."""
    return bool(args) and isinstance(result, torch.Tensor) and isinstance(args[0], torch.Tensor) and \
        _storage(result) == _storage(args[0])


def _leaves(args: tuple, kwargs: dict) -> tuple[list, tuple]:
    """The call's arguments flattened one tuple deep, and its structure (tuple lengths, keyword names)."""
    leaves, shape = [], []
    for value in (*args, *kwargs.values()):
        if type(value) is tuple:
            leaves.extend(value)
            shape.append(len(value))
        else:
            leaves.append(value)
            shape.append(-1)
    return leaves, (len(args), tuple(kwargs), tuple(shape))


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a step's result (a tensor or a tuple of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [part for part in value if isinstance(part, torch.Tensor)] if isinstance(value, tuple) else []


def _same_memory(given: torch.Tensor, recorded: torch.Tensor) -> bool:
    """Whether ``given`` (of ``recorded``'s layout) views the same memory of the same allocation, which
    ``recorded`` keeps alive: every view the step derived from ``recorded`` is then one of ``given`` too."""
    return given.data_ptr() == recorded.data_ptr() and _storage(given) == _storage(recorded)


def _layout(tensor: torch.Tensor) -> tuple:
    return tensor.dtype, tensor.shape, tensor.stride(), tensor.device


class _Step:
    """One recorded step: its launches, what each later call must match, and where its tensors go."""

    def __init__(self, name: str, structure: tuple, leaves: list, launches: list, result: Any) -> None:
        self.name, self.structure, self.result, self.launches = name, structure, result, launches
        self.fixed: list[tuple[int, Any]] = []  # (leaf, value): numbers must be equal, other objects the same
        self.numbers: list[tuple[int, float, list]] = []  # (leaf, value, places): floats passed on as they are
        self.tensors: list[tuple[int, tuple, list, Any]] = []  # (leaf, layout, [(launch, position, kind)], pin)
        self.replayable = self._place(leaves)

    def _place(self, leaves: list) -> bool:
        """Find each argument in the launches; False where the step cannot be replayed exactly."""
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        storages = {id(leaf): _storage(leaf) for leaf in tensors}
        if len(storages) < len(tensors):
            return False  # one tensor given twice: its places could not tell which argument they follow
        if any(_storage(out) in storages.values() for out in _tensors(self.result)):
            return False  # an output sharing memory with an input would not be the next layer's
        places: dict[int, list] = {id(leaf): [] for leaf in leaves}  # id -> [(launch, position, kind)]
        viewed: set[int] = set()  # storages of which a view that is no argument itself reached a kernel
        for index, launch in enumerate(self.launches):
            for position, value in enumerate(launch.values):
                if id(value) in places:
                    places[id(value)].append((index, position, "value"))
                    continue
                base = getattr(value, "base", None) if dataclasses.is_dataclass(value) else None
                if base is not None and id(base) in places:
                    places[id(base)].append((index, position, "descriptor"))
                elif isinstance(base if base is not None else value, torch.Tensor):
                    viewed.add(_storage(base if base is not None else value))
        for number, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                pin = leaf if storages[id(leaf)] in viewed else None  # only a tensor over its memory can replace it
                self.tensors.append((number, _layout(leaf), places[id(leaf)], pin))
            elif type(leaf) is float and places[id(leaf)]:  # a number of the layer's own (the SwiGLU's bound)
                self.numbers.append((number, leaf, places[id(leaf)]))
            else:
                self.fixed.append((number, leaf))
        return True

    def replay(self, leaves: list) -> Any:
        """Launch again with ``leaves``' tensors in place of the recorded ones; ``_MISS`` where they do not fit."""
        for number, recorded in self.fixed:
            given = leaves[number]
            if given is not recorded and not (type(recorded) in _PRIMITIVES and type(given) is type(recorded)
                                               and given == recorded):
                return _MISS
        changes: list[dict[int, Any]] = [{} for _ in self.launches]
        for number, recorded, places in self.numbers:
            given = leaves[number]
            if type(given) is not float:
                return _MISS
            if given != recorded:
                for index, position, _ in places:
                    if not self.launches[index].specializes_alike(position, given):
                        return _MISS  # (a constexpr: another compiled kernel)
                    changes[index][position] = given
        for number, layout, places, pin in self.tensors:
            given = leaves[number]
            if not isinstance(given, torch.Tensor) or _layout(given) != layout or (pin is not None and given is not pin
                                                                                and not _same_memory(given, pin)):
                return _MISS
            for index, position, kind in places:
                recorded = self.launches[index].values[position]
                if kind == "value":
                    if given is recorded:
                        continue
                    value = given
                else:
                    if recorded.base is given:
                        continue
                    value = _descriptor(recorded, given)
                if not self.launches[index].specializes_alike(position, value):
                    return _MISS
                changes[index][position] = value
        for launch, change in zip(self.launches, changes):
            launch.replay(change)
        return self.result


_DESCRIPTORS: dict[tuple, tuple[torch.Tensor, Any]] = {}  # (id(weight), the descriptor's form) -> (weight, it)


def _descriptor(recorded: Any, base: torch.Tensor) -> Any:
    """``recorded`` (a tensor descriptor) over ``base`` instead; a weight's (a Parameter) is made once and kept."""
    if not isinstance(base, torch.nn.Parameter):
        return dataclasses.replace(recorded, base=base)
    key = (id(base), type(recorded), tuple(recorded.shape), tuple(recorded.strides), tuple(recorded.block_shape),
           id(getattr(recorded, "layout", None)), recorded.padding)
    hit = _DESCRIPTORS.get(key)
    if hit is None or hit[0] is not base:
        if len(_DESCRIPTORS) >= 4096:
            _DESCRIPTORS.clear()
        hit = _DESCRIPTORS[key] = (base, dataclasses.replace(recorded, base=base))
    return hit[1]


class LayerReplay:
    """One eager forward's steps: :meth:`step` wraps a step's function; :meth:`next_layer` before each layer."""

    def __init__(self) -> None:
        self.steps: dict[int, _Step | None] = {}
        self.layer = -1
        self.position = 0
        self.replayed = 0  # calls replayed (for tests and benchmarks)

    def next_layer(self) -> None:
        self.layer += 1
        self.position = 0

    def wrap(self, ops: Any) -> Any:
        """A copy of the dataclass ``ops`` (``Fp8Ops``) with each function field a step."""
        return dataclasses.replace(ops, **{field.name: self.step(field.name, getattr(ops, field.name))
                                           for field in dataclasses.fields(ops)
                                           if callable(getattr(ops, field.name))})

    def step(self, name: str, fn: Callable) -> Callable:
        """``fn`` as a step of this forward's layers."""

        def call(*args: Any, **kwargs: Any) -> Any:
            position = self.position
            self.position += 1
            if self.layer == 0:
                return self._record(position, name, fn, args, kwargs)
            step = self.steps.get(position)
            if step is not None and step.name == name:
                leaves, structure = _leaves(args, kwargs)
                if structure == step.structure:
                    result = step.replay(leaves)
                    if result is not _MISS:
                        self.replayed += 1
                        return result
            return fn(*args, **kwargs)

        return call

    def _record(self, position: int, name: str, fn: Callable, args: tuple, kwargs: dict) -> Any:
        from rerankit.kernels import direct_launch

        with direct_launch.recording() as launches, _Watch() as watch:
            result = fn(*args, **kwargs)
        self.steps[position] = None
        if launches and None not in launches and not watch.other:
            leaves, structure = _leaves(args, kwargs)
            step = _Step(name, structure, leaves, launches, result)
            if step.replayable:
                self.steps[position] = step
        return result
