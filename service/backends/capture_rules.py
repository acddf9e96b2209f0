"""Capture rules: the CPU backend raising on what a captured CUDA graph cannot contain.

A CUDA graph replays the kernels recorded at capture with the same buffers and launch shapes,
and cannot record allocation, host copies or waits. `install(backend)` wraps a backend instance
so that, while a step function runs inside `run_step`:
- calls that allocate, copy to or from the host or wait (`FORBIDDEN`) raise;
- every array an op receives (inputs, weights' vectors, `out`) must be a view of a buffer the
  backend handed out before the step (`zeros`, `upload_vector`/`load_vector`, `rope_table`):
  a numpy temporary made by the model layer would be a fresh allocation on the GPU;
- the step's key determines its op sequence: the (op, argument shapes and dtypes) sequence of
  the first run of a key is recorded, and a later run of that key that differs raises (a
  data-dependent shape or branch, which a replayed graph would silently ignore).
Only calls from outside the backend are checked: an op's own internal calls (the CPU `moe`
calling `matmul` on its scratch rows) are the backend's business. Host reads of array values
by the model layer (`int(positions[0])`) are not detected: numpy arrays cannot refuse them.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Calls a step may not make: allocation, host <-> device copies, host waits, load-time work.
FORBIDDEN = ("zeros", "upload_vector", "upload_ints", "to_host", "synchronize", "new_kv_cache",
             "load_matrix", "load_experts", "load_vector", "load_embedding", "rope_table",
             "prepare", "set_block_table")
# Ops: their array arguments are checked and their shapes recorded.
OPS = ("embed", "rms_norm", "matmul", "add", "copy_rows", "rope", "glu", "kv_write", "attention",
       "moe", "argmax", "chosen_ids")
# Calls whose returned arrays become workspace (registered; they run before any step).
HANDS_OUT = ("zeros", "upload_vector", "rope_table")


class CaptureRuleError(RuntimeError):
    """A step did something a captured CUDA graph cannot contain; the message names the call."""


def _root(a: np.ndarray) -> np.ndarray:
    """The array owning a view's memory (following numpy's base chain)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _arrays(value: Any, name: str):
    """(name, array) for an array argument or the arrays inside a tuple/list argument."""
    if isinstance(value, np.ndarray):
        yield name, value
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            if isinstance(v, np.ndarray):
                yield f"{name}[{i}]", v


@dataclass
class CaptureState:
    """What the rules track for one backend instance."""

    buffers: dict[int, np.ndarray] = field(default_factory=dict)  # id(root) -> root
    sequences: dict[tuple, list[tuple]] = field(default_factory=dict)  # key -> op sequence
    key: tuple | None = None          # the key of the step running now
    trace: list[tuple] = field(default_factory=list)   # ops of the running step so far
    depth: int = 0                    # >0 while an op or forbidden call is executing
    steps: int = 0                    # steps completed under the rules

    @property
    def in_step(self) -> bool:
        return self.key is not None

    def register(self, result: Any) -> None:
        for _, a in _arrays(result, "result"):
            root = _root(a)
            self.buffers[id(root)] = root

    def is_workspace(self, a: np.ndarray) -> bool:
        root = _root(a)
        return self.buffers.get(id(root)) is root

    def check_arrays(self, where: str, named: list[tuple[str, np.ndarray]]) -> None:
        for name, a in named:
            if not self.is_workspace(a):
                raise CaptureRuleError(
                    f"{where}: argument {name!r} {a.shape} {a.dtype} is not a view of a buffer "
                    "from zeros()/upload_vector()/rope_table() made before the step (a "
                    "temporary allocated during the step; a CUDA graph cannot contain it)")

    def record(self, op: str, named: list[tuple[str, np.ndarray]]) -> None:
        entry = (op, tuple((n, a.shape, str(a.dtype)) for n, a in named))
        i = len(self.trace)
        self.trace.append(entry)
        first = self.sequences.get(self.key)
        if first is None:
            return
        if i >= len(first) or first[i] != entry:
            want = first[i] if i < len(first) else "the end of the step"
            raise CaptureRuleError(
                f"step key {self.key}: op #{i} is {entry}, the first run of this key had "
                f"{want}; the key must determine the op sequence and shapes (a data-dependent "
                "shape or branch cannot be replayed from a graph)")

    def finish(self) -> None:
        first = self.sequences.get(self.key)
        if first is None:
            self.sequences[self.key] = self.trace
        elif len(first) != len(self.trace):
            raise CaptureRuleError(
                f"step key {self.key}: {len(self.trace)} ops, the first run of this key had "
                f"{len(first)}; the key must determine the op sequence")
        self.steps += 1


def install(backend) -> CaptureState:
    """Wrap `backend`'s methods (on the instance) with the capture rules; returns their state."""
    state = CaptureState()
    for name in FORBIDDEN:
        setattr(backend, name, _forbidden(state, name, getattr(backend, name)))
    for name in OPS:
        setattr(backend, name, _op(state, name, getattr(backend, name)))
    backend.run_step = _run_step(state, backend.run_step)
    backend.capture_state = state
    return state


def _forbidden(state: CaptureState, name: str, method):
    @functools.wraps(method)
    def call(*args, **kwargs):
        if state.in_step:
            raise CaptureRuleError(f"{name}() called inside a step (key {state.key}): a CUDA "
                                   "graph cannot allocate, copy to or from the host, or wait")
        state.depth += 1
        try:
            result = method(*args, **kwargs)
        finally:
            state.depth -= 1
        if name in HANDS_OUT:
            state.register(result)
        return result
    return call


def _op(state: CaptureState, name: str, method):
    sig = inspect.signature(method)

    @functools.wraps(method)
    def call(*args, **kwargs):
        if state.in_step and state.depth == 0:
            bound = sig.bind(*args, **kwargs)
            named = [na for k, v in bound.arguments.items() for na in _arrays(v, k)]
            state.check_arrays(name, named)
            state.record(name, named)
        state.depth += 1
        try:
            return method(*args, **kwargs)
        finally:
            state.depth -= 1
    return call


def _run_step(state: CaptureState, method):
    @functools.wraps(method)
    def call(key, inputs, fn):
        if state.in_step:
            raise CaptureRuleError(f"run_step({key}) inside the step of key {state.key}")
        state.check_arrays(f"run_step{key} inputs",
                           [na for i, v in enumerate(inputs) for na in _arrays(v, f"inputs[{i}]")])
        state.key, state.trace = tuple(key), []
        try:
            result = method(key, inputs, fn)
            state.finish()
        finally:
            state.key, state.trace = None, []
        state.check_arrays(f"run_step{key} result", list(_arrays(result, "result")))
        return result
    return call
