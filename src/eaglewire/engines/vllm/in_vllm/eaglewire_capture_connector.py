"""A KV connector vLLM loads (``kv_connector_module_path``) to write captured hidden states on CPU.

This file runs inside vLLM's own interpreter, not eaglewire's: it imports vLLM only. eaglewire puts its
directory on the server's PYTHONPATH and names it in ``--kv-transfer-config``.

vLLM's ``ExampleHiddenStatesConnector`` (vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py, 0.32.0) copies the states out through a CUDA stream into pinned
memory; on the CPU build the engine dies there (``pin_memory=True requires a CUDA or other accelerator
backend``). ``CpuHiddenStatesConnector`` does the same extraction and write synchronously: the states are
already in host memory, so the file is whole (and its lock released) before the request is reported done.
On GPUs the stock connector is the one to use.

``ShiftedHiddenStatesConnector`` is a fault for eaglewire's tests: it writes the state of the next
requested id in each slot (the last slot keeps its own), as an engine whose layer numbering is one off
would. Nothing else should load it.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, PendingSave, extract_from_kv_cache)


class _Written:
    """Stands in for the CUDA event the stock connector polls: the write is done when it is recorded."""

    @staticmethod
    def query() -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous host write: same files, same lock protocol."""

    def _states(self, pending: PendingSave) -> torch.Tensor:
        """The request's cached states, [T, n, H] (n requested layer ids), copied out of the cache."""
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)  # [nb]
        offsets = torch.arange(self._block_size, dtype=torch.long)  # [bs]
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()  # [nb * bs]
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])  # [T, n, H]
        return states.to("cpu").contiguous().clone()

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        tensors = {"hidden_states": self._states(pending), "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file(tensors, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a reader waiting on LOCK_SH reads a whole file
        self._req_copy_events[pending.req_id] = _Written()


class ShiftedHiddenStatesConnector(CpuHiddenStatesConnector):
    """A fault (tests only): slot j holds the state of requested id j+1, the last slot its own."""

    def _states(self, pending: PendingSave) -> torch.Tensor:
        states = super()._states(pending)  # [T, n, H]
        return torch.cat([states[:, 1:], states[:, -1:]], dim=1).contiguous()  # [T, n, H]
