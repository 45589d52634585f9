"""Training batches read ahead on a background thread, so that reading shards and collating them is off
the step's critical path: while the device computes step s, the thread reads the batches of steps s+1, s+2.

The thread reads and collates on the host (pinned when the batch goes to a GPU); the training thread takes
the batches in plan order and moves them with ``non_blocking=True``. Same batches, same order, same values as
reading them in the step.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Iterator

import torch

from eaglewire.data.sources import Batch

log = logging.getLogger(__name__)

_DONE = object()


def batch_to(batch: Batch, device: torch.device, *, non_blocking: bool = False) -> Batch:
    """``batch`` with every tensor on ``device`` (unchanged when already there)."""
    moved = {f.name: (getattr(batch, f.name).to(device, non_blocking=non_blocking)
                      if isinstance(getattr(batch, f.name), torch.Tensor) else getattr(batch, f.name))
             for f in dataclasses.fields(batch)}
    return Batch(**moved)


def pin(batch: Batch) -> Batch:
    """``batch`` in page-locked host memory, so that a ``non_blocking`` copy to a GPU does not wait for the host."""
    return Batch(**{f.name: (getattr(batch, f.name).pin_memory()
                             if isinstance(getattr(batch, f.name), torch.Tensor) else getattr(batch, f.name))
                    for f in dataclasses.fields(batch)})


class Prefetcher:
    """Iterate ``load(indices)`` over ``plan`` in order, up to ``depth`` batches ahead on a thread.

    ``load`` returns a host batch; each is pinned when ``device`` is a GPU and handed out on ``device``.
    An error while reading is raised in the training thread, at the batch that failed. ``close()`` (or the
    end of a ``with`` block) stops the thread; unread batches are dropped.
    """

    def __init__(self, load: Callable[[list[int]], Batch], plan: list[list[int]], device: torch.device,
                 *, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.device = device
        self._pin = device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(load, plan), name="eaglewire-prefetch", daemon=True)
        self._thread.start()

    def _read(self, load: Callable[[list[int]], Batch], plan: list[list[int]]) -> None:
        for indices in plan:
            try:
                item = self._pinned(load(indices))
            except BaseException as e:  # handed to the training thread, raised there
                item = e
            if not self._put(item) or isinstance(item, BaseException):
                return
        self._put(_DONE)

    def _pinned(self, batch: Batch) -> Batch:
        if not self._pin:
            return batch
        try:
            return pin(batch)
        except RuntimeError as e:  # no page-locked memory to be had: the copy still works, the host waits for it
            log.info("prefetch: pinning host memory failed (%s); batches are copied unpinned", e)
            self._pin = False
            return batch

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        item = self._queue.get()
        if item is _DONE:
            self._queue.put(_DONE)  # a later next() stops too
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return batch_to(item, self.device, non_blocking=True)  # asynchronous from pinned memory

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InStep:
    """The same interface without a thread: each batch read when the step asks (``--prefetch 0``, online data)."""

    def __init__(self, load: Callable[[list[int]], Batch], plan: list[list[int]], device: torch.device) -> None:
        self._load, self._plan, self.device = load, iter(plan), device

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return batch_to(self._load(next(self._plan)), self.device)

    def close(self) -> None:
        pass
