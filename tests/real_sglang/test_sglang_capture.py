"""prepare --capture sglang on the real target through the real SGLang (two servers: the capture-only aux mode and
the final state for the labels, started once for the module).

The shards' aux states equal prepare's in-process bf16 capture of the same conversations per boundary, and the label
state, which SGLang answers after the final norm, gives the same logits through the target's head; the manifest says
SGLang captured them and how the label state was compared and stored. Both runs compute in bf16 (SGLang's CPU kernels
compute in nothing else), in other kernels: the gaps are bf16's, compounded over 30 layers.
"""

from __future__ import annotations

import json

import pytest
import torch

from eaglewire.data.prepare import PrepareConfig, prepare
from eaglewire.data.shards import ShardDataset

pytestmark = [pytest.mark.sglang, pytest.mark.real]

CONVERSATIONS = 6  # 4 captured both ways by the run's own check, the rest beyond
BOUNDARIES = [2, 15, 27]
GAP = 0.1  # the cross-check's bf16 tolerance (engine_capture.TOLERANCE): two bf16 runs in other kernels


def _config(out, **kwargs):
    return PrepareConfig(out=str(out), **({"num_conversations": CONVERSATIONS, "aux_boundaries": BOUNDARIES,
                                           "max_length": 256, "batch_tokens": 1024, "dtype": "bf16"} | kwargs))


def test_states_through_sglang_are_the_states_here(tmp_path, sglang_installation):
    here_dir, through_dir = tmp_path / "here", tmp_path / "sglang"
    prepare(_config(here_dir), progress=False)
    prepare(_config(through_dir, capture="sglang", capture_python=str(sglang_installation.python)), progress=False)
    status = json.loads((through_dir / "manifest.json").read_text())["status"]
    assert status["capture"] == f"sglang {sglang_installation.version}"
    check = status["capture_check"]
    assert check["sequences"] == 4 and sorted(map(int, check["max_relative_error"])) == BOUNDARIES + [30]
    assert max(check["max_relative_error"].values()) <= check["tolerance"] and "after the final norm" in check["label_state"]

    from eaglewire.model.target import load_target

    target = load_target("smollm2-135m", device="cpu", dtype="bf16")
    here, through = ShardDataset(here_dir), ShardDataset(through_dir)
    assert len(here) == len(through) > 4
    agree = total = 0
    for i in range(len(here)):
        x, y = here[i], through[i]
        assert torch.equal(x["input_ids"], y["input_ids"])
        gap = float((x["aux_hidden"].float() - y["aux_hidden"].float()).norm() / x["aux_hidden"].float().norm())
        assert gap < GAP, (i, gap)
        with torch.no_grad():  # the label state: the head on each gives the same next tokens, bf16 near-ties aside
            ours = target.head(x["last_hidden"][None].to(torch.bfloat16))[0].argmax(-1)
            theirs = target.head(y["last_hidden"][None].to(torch.bfloat16))[0].argmax(-1)
        agree, total = agree + int((ours == theirs).sum()), total + len(ours)
    assert agree / total > 0.97, (agree, total)
