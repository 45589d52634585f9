"""prepare --capture vllm on the real target through the real vLLM (three server starts: the connector as
shipped on one rank and tensor parallel over two, and a faulty one that hands each slot the next layer's state).

(a) the shards' states equal `prepare`'s in-process capture of the same conversations, per boundary (boundary L,
the label state, included), at tensor parallel 1 and 2, and the manifest says vLLM captured them; (b) the fault
stops the run naming the boundary, and no shard is written from it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eaglewire.data.engine_capture import EngineCaptureError
from eaglewire.data.prepare import PrepareConfig, prepare
from eaglewire.data.shards import ShardDataset

pytestmark = [pytest.mark.vllm, pytest.mark.real]

CONVERSATIONS = 6  # 4 captured both ways by the run's own check, the rest beyond
BOUNDARIES = [2, 15, 27]
STORED = 1e-2  # both runs store bf16: a state 1e-6 apart may round to the neighbouring bf16 value (2^-8 relative)


def _config(out, **kwargs):
    return PrepareConfig(out=str(out), num_conversations=CONVERSATIONS, aux_boundaries=BOUNDARIES, max_length=384,
                         batch_tokens=1536, dtype="fp32", **kwargs)


@pytest.fixture(scope="module")
def here(tmp_path_factory, smollm2_target):
    out = tmp_path_factory.mktemp("capture") / "here"
    prepare(_config(out), target=smollm2_target, progress=False)
    return ShardDataset(out)


def _same_as_here(here, out: Path) -> dict:
    """The shards in ``out`` are ``here``'s, state by state within bf16 storage; the manifest's status."""
    through = ShardDataset(out)
    assert len(through) == len(here) > 4  # some beyond the run's own check
    for i in range(len(here)):
        x, y = here[i], through[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for name in ("aux_hidden", "last_hidden"):
            gap = float((x[name].float() - y[name].float()).norm() / x[name].float().norm())
            assert gap < STORED, (i, name, gap)
    return json.loads((out / "manifest.json").read_text())["status"]


@pytest.mark.parametrize("ranks", [1, 2])
def test_states_through_vllm_are_the_states_here(ranks, here, tmp_path, smollm2_target, vllm_installation):
    """Tensor parallel over 2 processes (each rank on its own core) is the same path: the same states."""
    out = tmp_path / f"vllm-tp{ranks}"
    prepare(_config(out, capture="vllm", capture_python=str(vllm_installation.python), capture_tensor_parallel=ranks),
            target=smollm2_target, progress=False)
    status = _same_as_here(here, out)
    assert status["capture"] == f"vllm {vllm_installation.version}"
    check = status["capture_check"]
    assert check["sequences"] == 4 and sorted(map(int, check["max_relative_error"])) == BOUNDARIES + [30]
    assert max(check["max_relative_error"].values()) <= check["tolerance"]


def test_an_engine_handing_the_next_layer_stops_the_run_naming_the_boundary(tmp_path, smollm2_target,
                                                                           vllm_installation, monkeypatch):
    from eaglewire.engines.vllm import capture as vcap

    monkeypatch.setattr(vcap.CAPTURER, "connector", vcap.SHIFTED_CONNECTOR)
    with pytest.raises(EngineCaptureError) as e:
        prepare(_config(tmp_path / "fault", capture="vllm", capture_python=str(vllm_installation.python)),
                target=smollm2_target, progress=False)
    said = str(e.value)
    assert "state for boundary 2 is boundary 15 here" in said and "state for boundary 15 is boundary 27 here" in said
    assert not list((tmp_path / "fault").glob("shard-*.safetensors"))
