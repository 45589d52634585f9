"""CUDA graphs of fixed-shape decoding steps: captured once per shape, replayed with new inputs.

A decoding step of a large target on a GPU is a few hundred small kernels; launched one by one from Python
they cost more than the weights take to stream (an 8B target's step: 26 ms eager against a 3 ms roofline on
an H200). Captured into one graph, a step is one launch. What a graph needs: every input in a buffer that
lives as long as the graph (``StepGraphs`` copies each call's inputs in), no host synchronisation and no
allocation whose address changes (a captured step writes its cache by index, never by a Python slice that
moves), and the same shapes at every replay (one graph per key, e.g. the number of tokens).

gpt-fast's recipe (static KV cache, ``torch.compile(mode="reduce-overhead")``) without the compiler: the
step's kernels are the eager ones, so a captured step computes what an eager call of the same function does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

WARMUP_CALLS = 2  # before capture, on a side stream: lets cuBLAS and the allocator settle (PyTorch's advice)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # the buffers the graph reads
    outputs: tuple[torch.Tensor, ...]  # the buffers the graph writes (overwritten by the next replay)


class StepGraphs:
    """``fn(**inputs) -> tuple of tensors``, replayed from a CUDA graph per key.

    ``fn`` must be idempotent for the same inputs (warm-up calls run it for real: a decoding step that writes
    the block's K/V at the block's own columns and reads only committed columns is). The outputs are the
    graph's own buffers: read or copy them before the next call.
    """

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], name: str = "a step") -> None:
        self.fn, self.name = fn, name
        self._graphs: dict[Hashable, _Captured] = {}
        self._pool = None  # one memory pool for every graph of this step: they never run at once

    def __call__(self, key: Hashable, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._graphs[key] = self._capture(inputs)
        else:
            for name, value in inputs.items():
                captured.inputs[name].copy_(value, non_blocking=True)
        captured.graph.replay()
        return captured.outputs

    def copies(self, key: Hashable, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """``self(key, **inputs)`` with its outputs copied (the next replay overwrites the graph's buffers); None,
        with one warning, where capturing it fails here (a driver, a kernel that refuses): the caller runs ``fn``
        eagerly from then on."""
        try:
            return tuple(t.clone() for t in self(key, **inputs))
        except RuntimeError as err:
            log.warning("%s runs without CUDA graphs: capturing it for %s failed (%s)", self.name, key, err)
            return None

    def clear(self) -> None:
        """Forget every graph (what they read, e.g. a cache that grew, has moved)."""
        self._graphs.clear()
        self._pool = None

    def __len__(self) -> int:
        return len(self._graphs)

    def _capture(self, inputs: dict[str, torch.Tensor]) -> _Captured:
        static = {name: value.clone() for name, value in inputs.items()}  # buffers that outlive this call
        graph, outputs = capture(lambda: self.fn(**static), self._pool)
        self._pool = graph.pool()
        log.debug("captured a step graph for %s", {k: tuple(v.shape) for k, v in static.items()})
        return _Captured(graph=graph, inputs=static, outputs=tuple(outputs))


def capture(body: Callable[[], Any], pool=None, *, warmup: int = WARMUP_CALLS,
            device: torch.device | None = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``body`` run ``warmup`` times on a side stream, then recorded as one CUDA graph in ``pool``: (the graph,
    what the recorded call returned: the buffers each replay writes)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = body()
    return graph, outputs
