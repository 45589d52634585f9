"""Hidden states captured by vLLM: its ``extract_hidden_states`` method, written by eaglewire's CPU connector.

vLLM 0.32.0 (vllm/v1/spec_decode/extract_hidden_states.py, vllm/v1/worker/gpu_model_runner.py
``_get_eagle3_aux_layers_from_config``) reads ``draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids``
as it reads an EAGLE-3 draft's ids: sorted, id i the state after layer i (``_maybe_add_hidden_state(idx + 1)``
in llama.py: hidden + residual, before the final norm; id 0 the embedding output). So the ids sent are
``readings.to_ids`` of the contract's boundaries plus boundary L (the label state), and slot j of the file
holds ``readings.to_boundaries(ids)[j]``. Each completion (``max_tokens`` 1) answers with
``kv_transfer_params.hidden_states_path``: a safetensors file of ``hidden_states`` [T, n, H] and
``token_ids`` [T] (states_file.py, its one reader), written by the connector in ``in_vllm/`` (vLLM's own
connector dies on CPU), guarded by a ``.lock`` the reader takes shared.

``--capture-url`` points at a vLLM the user runs with ``launch_line``'s flags; its storage path must be
readable here (the same machine or a shared filesystem).
"""

from __future__ import annotations

import fcntl
import json
import logging
import shlex
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from eaglewire.engines.interface import CaptureSettings, ServedFiles, Shape, StatesFile
from eaglewire.engines.serving.served_counts import post_json
from eaglewire.engines.vllm.installation import VllmError, require
from eaglewire.engines.vllm.readings import NAME, to_boundaries, to_ids
from eaglewire.engines.vllm.server import VllmServer, served_target, served_version
from eaglewire.engines.vllm.states_file import read_states_file

log = logging.getLogger(__name__)

CONNECTOR_DIR = Path(__file__).resolve().parent / "in_vllm"  # on the server's PYTHONPATH
CONNECTOR_MODULE = "eaglewire_capture_connector"
CONNECTOR = "CpuHiddenStatesConnector"
SHIFTED_CONNECTOR = "ShiftedHiddenStatesConnector"  # a fault for the tests: slot j holds id j+1's state
GPU_CONNECTOR = "ExampleHiddenStatesConnector"  # vLLM's own, for GPU servers (launch_line)


def capture_ids(boundaries: Sequence[int], num_layers: int, arch: str | None) -> list[int]:
    """The ids vLLM is sent for ``boundaries`` and boundary ``num_layers`` (the label state), as it reads them."""
    return to_ids(sorted(set(boundaries) | {num_layers}), num_layers, arch)


def speculative_config(ids: Sequence[int]) -> dict:
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(ids)}}}


def kv_transfer_config(storage: Path, connector: str = CONNECTOR) -> dict:
    """The connector that writes each request's states under ``storage`` (ours from its module; vLLM's own
    where ``connector`` is GPU_CONNECTOR)."""
    config = {"kv_connector": connector, "kv_role": "kv_producer",
              "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    if connector != GPU_CONNECTOR:
        config["kv_connector_module_path"] = CONNECTOR_MODULE
    return config


def capture_flags(ids: Sequence[int], storage: Path, *, connector: str = CONNECTOR,
                  tensor_parallel: int = 1) -> list[str]:
    flags = ["--speculative-config", json.dumps(speculative_config(ids)),
             "--kv-transfer-config", json.dumps(kv_transfer_config(storage, connector))]
    if tensor_parallel > 1:
        flags += ["--tensor-parallel-size", str(tensor_parallel)]
    return flags


@contextmanager
def _written(path: Path) -> Iterator[None]:
    """Holds a request's file once the connector has written it whole; removes it and its lock on leaving."""
    lock = Path(str(path) + ".lock")
    if not path.exists() and not lock.exists():
        raise VllmError(f"vLLM wrote its states to {path}, which is not here: run the server on this machine or "
                        "give it a shared_storage_path this machine reads")
    try:
        with open(lock) if lock.exists() else open(path) as held:
            fcntl.flock(held, fcntl.LOCK_SH)  # sleeps until the connector's write releases LOCK_EX
            yield
    finally:
        for p in (path, lock):
            p.unlink(missing_ok=True)


def read_states(path: Path, token_ids: Sequence[int], slots: int) -> torch.Tensor:
    """The states a request's file holds, [T, slots, H] in float32, checked against what was sent; the file and
    its lock removed once read."""
    with _written(path):
        found = read_states_file(path)
    states, written = found.states, found.token_ids.tolist()
    if written != list(token_ids):
        raise VllmError(f"vLLM's states in {path} are of {len(written)} tokens other than the {len(token_ids)} sent "
                        "(a prefix cache or a tokenizer in between?): launch it with --no-enable-prefix-caching and "
                        "send token ids")
    if states.dim() != 3 or states.shape[1] != slots:
        raise VllmError(f"vLLM's states in {path} have shape {list(states.shape)}, not [T, {slots}, H]: the server "
                        f"captures other layer ids than the {slots} eaglewire asks for; launch it with the flags "
                        "`eaglewire prepare --capture vllm` prints")
    return states.float()


@dataclass
class VllmCapturedStates:
    """A vLLM at ``url`` capturing ``boundaries`` (the ``CapturedStates`` of the engine interface)."""

    url: str
    version: str
    boundaries: list[int]
    ids: list[int]
    timeout: float = 600.0
    last_state: str = "pre-norm"  # vLLM hands the last layer's output, before the final norm

    def states(self, token_ids: list[int]) -> torch.Tensor:
        body = {"prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0, "stream": False}
        answer = post_json(self.url.rstrip("/") + "/v1/completions", body, timeout=self.timeout,
                           who="vLLM server", error=VllmError, hint="; pass the server's base URL as --capture-url")
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise VllmError(f"the vLLM at {self.url} answered without kv_transfer_params.hidden_states_path: it runs "
                            "without state extraction; launch it with the flags `eaglewire prepare --capture vllm` "
                            "prints")
        return read_states(Path(path), token_ids, len(self.ids))

    def discard(self, answer: dict) -> None:
        """A generation's answer: vLLM wrote the states of its prompt and reply too (every request is captured);
        the file is removed once written, so the storage holds only what is read."""
        path = ((answer or {}).get("kv_transfer_params") or {}).get("hidden_states_path")
        if path:
            with _written(Path(path)):
                pass


@dataclass
class VllmCapturer:
    """vLLM as ``prepare --capture vllm`` runs it (the ``Capturer`` of the engine interface)."""

    label: str = "vLLM"
    connector: str = CONNECTOR  # SHIFTED_CONNECTOR in the tests' fault

    def read_file(self, path: Path, *, token_ids: bool = True) -> StatesFile:
        return read_states_file(path, token_ids=token_ids)

    def launch_line(self, target: str, boundaries: list[int], num_layers: int, arch: str | None,
                    settings: CaptureSettings, storage: Path) -> str:
        ids = capture_ids(boundaries, num_layers, arch)
        flags = capture_flags(ids, storage, connector=GPU_CONNECTOR, tensor_parallel=settings.tensor_parallel)
        return shlex.join(["vllm", "serve", str(served_target(target)), "--dtype", settings.dtype,
                           "--no-enable-prefix-caching",
                           *flags])

    @contextmanager
    def capture(self, target: str, boundaries: list[int], num_layers: int, arch: str | None,
                settings: CaptureSettings, *, work_dir: Path, url: str | None = None) -> Iterator[VllmCapturedStates]:
        ids = capture_ids(boundaries, num_layers, arch)
        slots = to_boundaries(ids, num_layers, arch)
        if url is not None:
            version = served_version(url) or "unknown"
            yield VllmCapturedStates(url, f"{NAME} {version}", slots, ids)
            return
        installation = require(settings.install)
        storage = Path(work_dir) / "vllm-states"
        storage.mkdir(parents=True, exist_ok=True)
        files = ServedFiles(target=served_target(target), draft=None)
        flags = capture_flags(ids, storage, connector=self.connector)
        with VllmServer(installation, files, Shape(n_max=0), threads=settings.threads, flags=flags,
                        dtype=settings.dtype,
                        max_model_len=settings.max_model_len, pythonpath=[CONNECTOR_DIR],
                        tensor_parallel=settings.tensor_parallel,
                        log_path=Path(work_dir) / "vllm-capture.log") as server:
            log.info("vLLM %s captures ids %s (boundaries %s) at %s", installation.version, ids, slots, server.url)
            yield VllmCapturedStates(server.url, f"{NAME} {installation.version}", slots, ids)


CAPTURER = VllmCapturer()
