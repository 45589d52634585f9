"""Capture the next batch while the last one is written: host staging and the shard-writing thread.

Shapes: B batch, T tokens (padded), N the batch's real tokens (the sum of its lengths), H hidden size,
k number of aux boundaries.

On CUDA nothing in the capture loop waits for the device: a batch's states are packed (padding dropped),
put in their stored dtypes and checked there (``state_codec.encode_states``), then queued for copying into
page-locked host memory behind the forward; an event marks when the copy is done. ``WriterThread`` waits
for that event and hands the batch to the ``ShardWriter`` (its checks, shard encoding, sha256, fsync and
manifest) on its own thread, while the main thread launches the next forward. The queue between them is
short, so at most a few batches are in flight, and a writer error (a full disk, a non-finite state) is
raised in the main thread at its next hand-over. Everything the writer commits is committed as before:
shard, then manifest, each atomically; a batch still queued when a run stops is redone by a resume.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from eaglewire.data.shards import ShardWriter

log = logging.getLogger(__name__)

DEPTH = 2  # batches queued for the writer beyond the one it writes


@dataclass
class StagedBatch:
    """One captured batch on its way to the shards, as ``ShardWriter.add_encoded`` takes it. Its host tensors
    hold the states once ``ready`` (a CUDA event; None: already) has passed."""

    ids: list[str]
    lengths: list[int]
    input_ids: torch.Tensor  # [N] int32
    loss_mask: torch.Tensor  # [N] uint8
    stored: dict[str, torch.Tensor]  # stored dtypes: aux_hidden [N, k*H], last_hidden [N, H], ...
    checks: torch.Tensor  # [N, 6] (state_codec.state_checks)
    label_rows: list[int] | None = None  # top-K labels: labelled positions per sequence
    ready: Any = None

    def commit(self, writer: ShardWriter) -> None:
        """Wait for the copies, then check and buffer the batch (writing any shard it completes)."""
        if self.ready is not None:
            self.ready.synchronize()
        writer.add_encoded(self.ids, self.lengths, self.input_ids, self.loss_mask, self.stored, self.checks,
                           self.label_rows)


def to_host(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
    """``tensors`` on the CPU, and the CUDA event after which they are there (None: they are now). From CUDA
    the copies are queued behind the work that computes them, into page-locked memory (where torch is built
    with CUDA), and nothing waits here."""
    devices = {x.device.type for x in tensors.values()}
    if devices != {"cuda"}:
        return {name: x.to("cpu") for name, x in tensors.items()}, None
    host = {name: torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x, non_blocking=True)
            for name, x in tensors.items()}
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


class WriterThread:
    """Run jobs on one background thread, in order, with at most ``depth`` waiting (``submit`` blocks beyond).

    The first job that raises stops the thread's work (later jobs are dropped) and its exception is raised in
    the caller at the next ``submit`` or at ``close``. Leaving the ``with`` block normally drains the queue
    and joins the thread; leaving it by an exception (Ctrl-C, a failed capture) still lets the queued jobs
    finish, so what was captured is written, and logs, rather than raises, a writer error then.
    """

    def __init__(self, depth: int = DEPTH, name: str = "shard-writer"):
        if depth < 1:
            raise ValueError(f"depth must be >= 1 queued job, got {depth}")
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if self._error is None:
                try:
                    job()
                except BaseException as e:  # noqa: BLE001 -- handed to the main thread
                    self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; first raise the error of an earlier one, if any."""
        self._raise()
        if not self._thread.is_alive():
            raise RuntimeError("the shard writer thread is closed; create a new one to submit more")
        self._queue.put(job)

    def close(self) -> None:
        """Finish the queued jobs and stop; raise the error of a job that failed."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise()

    def __enter__(self) -> WriterThread:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except BaseException as e:  # noqa: BLE001 -- the exception already leaving the block is the one to see
            log.warning("the shard writer also failed while the run stopped: %s", e)
