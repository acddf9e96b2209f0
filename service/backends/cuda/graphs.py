"""Step graphs of the CUDA backend: one captured CUDA graph per step shape and input buffers.

The first step of a key runs eagerly (it loads the kernels it needs), the second is captured
and launched, later ones replay the graph. A key is the step's shape (token count first, as the
model runner builds it) followed by its input arrays' device pointers. Kernels read token ids,
positions and KV slots from device buffers and never take a KV length from the host, so one
graph per (tokens, logits) shape serves every position. Steps wider than GRAPH_MAX_TOKENS
(prefill chunks) always run eagerly.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from service.backends.base import capture_sizes
from service.backends.cuda.launcher import ActivationBlocks, Launcher

GRAPH_MAX_TOKENS = 64     # steps up to this many tokens are captured (decode and verify)


def step_sizes(max_tokens: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16 (captured: decode and verify), then powers of two up to max_tokens
    (prefill chunks run eagerly, so their sizes cost no graph; a short prompt is padded to
    at most twice its length instead of to a whole chunk)."""
    sizes, n = set(capture_sizes(max_tokens)), 32
    while n < max_tokens:
        sizes.add(n)
        n *= 2
    return tuple(sorted(sizes))


class StepGraphs:
    def __init__(self, stream: Any, launcher: Launcher, blocks: ActivationBlocks,
                 enabled: bool, max_tokens: int = GRAPH_MAX_TOKENS) -> None:
        self.stream = stream
        self.enabled = enabled                       # False: every step runs eagerly
        self.max_tokens = max_tokens                 # wider steps run eagerly
        self.graphs: dict[tuple, tuple[Any, Any]] = {}   # key -> (graph, fn's result)
        self.seen: set[tuple] = set()                # keys run once (eagerly)
        self.replays: collections.Counter[tuple] = collections.Counter()   # key -> launches
        self._launcher = launcher
        self._blocks = blocks

    def run(self, key: tuple, inputs: tuple, fn: Callable[[], Any]) -> Any:
        self._blocks.forget()             # a step starts and ends knowing no blocks
        try:
            return self._run(key, inputs, fn)
        finally:
            self._blocks.forget()

    def _run(self, key: tuple, inputs: tuple, fn: Callable[[], Any]) -> Any:
        if not self.enabled or key[0] > self.max_tokens:
            return fn()
        full = (*key, *(a.data.ptr for a in inputs))
        hit = self.graphs.get(full)
        if hit is not None:
            graph, result = hit
            graph.launch(stream=self.stream)
            self.replays[full] += 1
            return result
        if full not in self.seen:         # first use: eager, loads every kernel it needs
            self.seen.add(full)
            return fn()
        self.stream.begin_capture()
        self._launcher.capturing = True
        try:
            result = fn()
        finally:
            self._launcher.capturing = False
            graph = self.stream.end_capture()
        self.graphs[full] = (graph, result)
        graph.launch(stream=self.stream)
        return result
