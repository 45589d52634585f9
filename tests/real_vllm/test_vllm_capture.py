"""prepare --capture vllm on the real target through the real vLLM (two server starts: the connector as shipped,
and a faulty one that hands each slot the next requested layer's state).

(a) the shards' states equal `prepare`'s in-process capture of the same conversations, per boundary (boundary L,
the label state, included), and the manifest says vLLM captured them; (b) the fault stops the run naming the
boundary, and no shard is written from it.
"""

from __future__ import annotations

import json

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


def test_states_through_vllm_are_the_states_here(tmp_path, smollm2_target, vllm_installation):
    here = prepare(_config(tmp_path / "here"), target=smollm2_target, progress=False)
    through = prepare(_config(tmp_path / "vllm", capture="vllm", capture_python=str(vllm_installation.python)),
                      target=smollm2_target, progress=False)
    assert through.sequences == here.sequences > 4  # some beyond the run's own check
    manifest = json.loads((tmp_path / "vllm" / "manifest.json").read_text())
    assert manifest["status"]["capture"] == f"vllm {vllm_installation.version}"
    check = manifest["status"]["capture_check"]
    assert check["sequences"] == 4 and sorted(map(int, check["max_relative_error"])) == BOUNDARIES + [30]
    assert max(check["max_relative_error"].values()) <= check["tolerance"]
    a, b = ShardDataset(tmp_path / "here"), ShardDataset(tmp_path / "vllm")
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for name in ("aux_hidden", "last_hidden"):
            gap = float((x[name].float() - y[name].float()).norm() / x[name].float().norm())
            assert gap < STORED, (i, name, gap)


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
