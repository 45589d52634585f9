"""prepare --capture vllm on the real target through the real vLLM (five server starts: the connector as
shipped, a head-only target, tensor parallel over two processes on a random 4-head Llama, regeneration and
capture in one server, and a faulty one that hands each slot the next layer's state).

(a) the shards' states equal `prepare`'s in-process capture of the same conversations, per boundary (boundary L,
the label state, included), at tensor parallel 1 and 2, and the manifest says vLLM captured them; (b) the server
that captures also regenerates: greedy replies equal the target's here, and no state file of its generations is
left behind; (c) the fault stops the run naming the boundary, and no shard is written from it.
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
    return PrepareConfig(out=str(out), **({"num_conversations": CONVERSATIONS, "aux_boundaries": BOUNDARIES,
                                           "max_length": 384, "batch_tokens": 1536, "dtype": "fp32"} | kwargs))


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


def _check_status(status: dict, version: str, boundaries: list[int], sequences: int = 4) -> None:
    assert status["capture"] == f"vllm {version}"
    check = status["capture_check"]
    assert check["sequences"] == sequences and sorted(map(int, check["max_relative_error"])) == boundaries
    assert max(check["max_relative_error"].values()) <= check["tolerance"]


def test_states_through_vllm_are_the_states_here(here, tmp_path, smollm2_target, vllm_installation):
    out = tmp_path / "vllm"
    prepare(_config(out, capture="vllm", capture_python=str(vllm_installation.python)), target=smollm2_target,
            progress=False)
    _check_status(_same_as_here(here, out), vllm_installation.version, BOUNDARIES + [30])


def test_a_head_only_target_captures_the_same_states_through_vllm(here, tmp_path, vllm_installation):
    """prepare --head-only --capture vllm: the target is never loaded whole here (its last layer checks vLLM's
    label slot on vLLM's own boundary L-1), and the shards are the in-process capture's."""
    out = tmp_path / "head-only"
    prepare(_config(out, capture="vllm", head_only=True, capture_python=str(vllm_installation.python)),
            progress=False)
    status = _same_as_here(here, out)
    assert status["capture"] == f"vllm {vllm_installation.version}"
    check = status["capture_check"]
    assert check["sequences"] == 4 and list(check["max_relative_error"]) == ["30"]
    assert check["max_relative_error"]["30"] <= check["tolerance"] and "boundary L-1" in check["instead"]


def test_tensor_parallel_over_two_processes_gives_the_same_states(tmp_path, smollm2_tokenizer, vllm_installation):
    """vLLM on CPU runs tensor parallel across processes (one core each here): the same path, the same states.
    SmolLM2's 9 heads do not split over 2 ranks, so a random Llama with 4 heads (2 key/value heads, head size 64)
    and SmolLM2's tokenizer and chat template stands in."""
    from eaglewire.model.target import load_target
    from tiny import tiny_target

    tiny = tiny_target("llama", vocab_size=len(smollm2_tokenizer), tokenizer=smollm2_tokenizer, num_layers=4,
                       hidden_size=256, initializer_range=0.2)
    target_dir = tmp_path / "target"
    tiny.model.save_pretrained(target_dir)
    smollm2_tokenizer.save_pretrained(target_dir)
    target = load_target(str(target_dir), device="cpu", dtype="fp32")
    boundaries = [1, 2, 3]
    prepare(_config(tmp_path / "here", target=str(target_dir), aux_boundaries=boundaries), target=target,
            progress=False)
    out = tmp_path / "vllm-tp2"
    prepare(_config(out, target=str(target_dir), aux_boundaries=boundaries, capture="vllm",
                    capture_python=str(vllm_installation.python), capture_tensor_parallel=2),
            target=target, progress=False)
    _check_status(_same_as_here(ShardDataset(tmp_path / "here"), out), vllm_installation.version, boundaries + [4])


NEAR_TIE = 1e-2  # a top-2 logit gap two engines' fp32 kernels cannot flip (they move logits by ~1e-4)


def _top2_gap(target, messages) -> float:
    """The smallest gap between the target's two largest logits over the reply's tokens (greedy: the reply's own)."""
    from eaglewire.data.regenerate import prompt_ids

    prompt = prompt_ids(target.tokenizer, messages[:1], None)
    reply = target.tokenizer(messages[1]["content"], add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + reply])).logits[0, len(prompt) - 1:-1]  # [len(reply), V]
    top = logits.topk(2, dim=-1).values  # [len(reply), 2]
    return float((top[:, 0] - top[:, 1]).min())


def test_one_vllm_regenerates_and_captures(tmp_path, smollm2_target, vllm_installation):
    """prepare --regenerate --capture vllm: vLLM with extract_hidden_states generates the replies (greedy: the
    target's here, token for token) and captures the regenerated conversations (the run's own check compares them
    with the states here); the state files vLLM writes for every generation are removed as they come."""
    from eaglewire.core.presets import data_path
    from eaglewire.data.conversations import load_conversations
    from eaglewire.data.regenerate import RegenerateConfig, regenerate

    # Greedy replies of two engines are compared token for token, so no reply may hold a near-tie: their fp32
    # states differ by up to 3e-6 relative (BENCHMARKS "Issue 40"), ~1e-4 on logits of ~22, and conversation 1 of
    # ShareGPT has a top-2 gap of 9e-5, which another CPU's kernels may flip. Conversations 2-4 have gaps of at least
    # 0.065 (checked below on this machine), 500x what the kernels move.
    n, new, offset = 3, 24, 2
    out = tmp_path / "regen-vllm"
    prepare(_config(out, num_conversations=n, offset=offset, regenerate=True, max_new_tokens=new, max_turns=1,
                    capture="vllm", capture_python=str(vllm_installation.python)), target=smollm2_target,
            progress=False)
    conversations, _ = load_conversations(data_path("sharegpt"), limit=n, offset=offset)
    regenerate(smollm2_target, conversations, tmp_path / "here.jsonl",
               config=RegenerateConfig(max_new_tokens=new, max_turns=1))
    here, _ = load_conversations(tmp_path / "here.jsonl")
    assert min(_top2_gap(smollm2_target, c.messages) for c in here) >= NEAR_TIE  # the comparison's premise
    through, _ = load_conversations(out / "regenerated.rank0.jsonl")
    assert {c.id: c.messages for c in through} == {c.id: c.messages for c in here} and len(here) == n
    assert not any((out / "vllm-states").iterdir())  # the generations' states were discarded, the shards' read
    status = json.loads((out / "manifest.json").read_text())["status"]
    assert status["complete"] and status["regenerated_by"]["mode"] == "server"
    _check_status(status, vllm_installation.version, BOUNDARIES + [30], sequences=n)


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
