"""The file vLLM's hidden-state connectors write per request, and its one reader.

vLLM 0.33.0's ``ExampleHiddenStatesConnector`` (GPU servers) and eaglewire's ``CpuHiddenStatesConnector``
(``in_vllm/``) save ``{"hidden_states": [T, n, H], "token_ids": [T]}`` to ``<shared_storage_path>/<req_id>.safetensors``:
slot j holds the state of the j-th id sent (``eagle_aux_hidden_state_layer_ids``, sorted). speculators'
``generate-offline-data`` moves each such file to ``hs_{i}.safetensors`` unchanged. Both ``prepare --capture vllm``
(capture.py) and ``import-data --from vllm | speculators`` (data/foreign.py, through the capturer's
``read_file``) read it here.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from eaglewire.engines.interface import StatesFile

HIDDEN_STATES = "hidden_states"
TOKEN_IDS = ("token_ids", "input_ids")  # the connector's name, then the one a converted file may carry


def read_states_file(path: Path, *, token_ids: bool = True) -> StatesFile:
    """The states and token ids of one connector file (a leading batch of one dropped). KeyError naming the
    missing tensor (``token_ids``: whether the token ids are required); safetensors' errors or OSError for a
    file that does not read."""
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        ids_name = next((n for n in TOKEN_IDS if n in keys), None)
        missing = [HIDDEN_STATES] if HIDDEN_STATES not in keys else []
        if token_ids and ids_name is None:
            missing.append(TOKEN_IDS[0])
        if missing:
            raise KeyError(f"no tensor {', '.join(missing)} (it holds {', '.join(sorted(keys)) or 'none'})")
        states = f.get_tensor(HIDDEN_STATES)
        ids = f.get_tensor(ids_name).flatten() if ids_name else None
    if states.ndim == 4 and states.shape[0] == 1:
        states = states[0]  # [T, n, H]
    return StatesFile(states, ids)
