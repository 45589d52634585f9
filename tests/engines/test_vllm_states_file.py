"""vLLM's per-request hidden-state file, read by its one reader (its capture and import-data both use it)."""

import pytest
import torch
from safetensors.torch import save_file

from eaglewire import engines
from eaglewire.engines.vllm.states_file import read_states_file


def test_the_connectors_file_reads_back_as_written(tmp_path):
    path = tmp_path / "req.safetensors"
    states = torch.randn(5, 3, 4).to(torch.bfloat16)  # [T, n, H]
    save_file({"hidden_states": states, "token_ids": torch.arange(5)}, str(path))
    found = read_states_file(path)
    assert torch.equal(found.states, states) and found.states.dtype == torch.bfloat16  # stored dtype, bit for bit
    assert found.token_ids.tolist() == [0, 1, 2, 3, 4]
    save_file({"hidden_states": states[None], "input_ids": torch.arange(5)[None]}, str(path))  # a batch of one
    found = read_states_file(path)
    assert found.states.shape == (5, 3, 4) and found.token_ids.tolist() == [0, 1, 2, 3, 4]
    # the rest of eaglewire reads it through the engine's capturer (import-data of vLLM's and speculators' files)
    assert torch.equal(engines.get("vllm").capturer.read_file(path).states, found.states)


def test_a_missing_tensor_is_named_with_what_the_file_holds(tmp_path):
    path = tmp_path / "req.safetensors"
    save_file({"hidden_states": torch.zeros(2, 1, 4)}, str(path))
    with pytest.raises(KeyError, match=r"no tensor token_ids \(it holds hidden_states\)"):
        read_states_file(path)
    assert read_states_file(path, token_ids=False).token_ids is None  # speculators' rows hold the tokens
    save_file({"token_ids": torch.arange(2)}, str(path))
    with pytest.raises(KeyError, match="no tensor hidden_states"):
        read_states_file(path, token_ids=False)
