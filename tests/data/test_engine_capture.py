"""prepare --capture ENGINE, without an engine: the per-boundary cross-check, the slot split, vLLM's capture
flags and files, and the refusals of bad flags."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eaglewire.data.engine_capture import (TOLERANCE, EngineCaptureError, check_slots, problems, require_same_states,
                                           split_states, states_here)
from eaglewire.data.prepare import PrepareConfig, engine_batch
from eaglewire.data.remote_regenerate import RemoteConfig
from eaglewire.engines.vllm import capture as vcap
from eaglewire.engines.vllm.installation import VllmError
from eaglewire.core.contract import HiddenStateContract
from eaglewire.data.conversations import TokenizedConversation
from tiny import tiny_target

TOKENS = [5, 17, 3, 99, 42, 7, 250, 11, 64, 128]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", num_layers=6)


def engine_slots(target, slots, *, shift: int = 0):
    """What an engine would hand back for ``slots``: the in-process states, slot j from boundary slots[j] + shift."""
    here = states_here(target, TOKENS)
    L = target.num_layers
    return torch.stack([here[min(b + shift, L)] for b in slots], dim=1)  # [T, n, H]


def test_states_here_are_every_boundary_of_the_capture(target):
    """Boundary b < L is layer b's input, L the last layer's output before the final norm (model/boundary_capture.py)."""
    from eaglewire.model.boundary_capture import capture

    here = states_here(target, TOKENS)
    assert sorted(here) == list(range(target.num_layers + 1))
    out = capture(target, torch.tensor([TOKENS]), [0, 3])
    H = out.last_hidden.shape[-1]
    assert torch.equal(here[0], out.aux_hidden[0, :, :H]) and torch.equal(here[3], out.aux_hidden[0, :, H:])
    assert torch.equal(here[target.num_layers], out.last_hidden[0])


def test_an_engine_handing_its_own_boundaries_passes(target):
    slots = [0, 2, 4, 6]
    states = engine_slots(target, slots) + 1e-7  # another summation order
    checks = require_same_states(states, slots, target, TOKENS, "vllm 0.32.0", sequence="c1")
    assert [c.boundary for c in checks] == slots and all(c.closest == c.boundary for c in checks)


def test_an_off_by_one_engine_stops_naming_the_boundary_it_handed(target):
    """Slot for id i holding layer i+1's state (TorchSpec #87's kind of fault): each wrong slot is named with the
    boundary it is instead; the label slot that is right is not."""
    slots = [1, 3, 6]
    states = engine_slots(target, slots, shift=1)  # 1 -> 2, 3 -> 4, 6 -> 6
    with pytest.raises(EngineCaptureError) as e:
        require_same_states(states, slots, target, TOKENS, "vllm 0.32.0", sequence="conversation c1")
    said = str(e.value)
    assert "vllm 0.32.0's state for boundary 1 is boundary 2 here" in said
    assert "boundary 3 is boundary 4 here" in said
    assert "boundary 6" not in said.split("Nothing was written")[0].split("tolerance")[1]
    assert "conversation c1" in said and "Nothing was written" in said


def test_a_post_norm_label_state_is_no_boundary(target):
    """The last slot after the final norm (what transformers' hidden_states[-1] holds) is no boundary here."""
    L = target.num_layers
    states = engine_slots(target, [2, L])
    with torch.no_grad():
        states[:, 1] = target.decoder.norm(states[:, 1])
    found = problems(check_slots(states, [2, L], states_here(target, TOKENS)), TOLERANCE[torch.float32], "vllm", L)
    assert len(found) == 1 and found[0].startswith(f"vllm's state for boundary {L} (the label state, before the final "
                                                   "norm) is no boundary here")


def test_an_attention_sink_does_not_hide_an_off_by_one_in_bf16():
    """SmolLM2's states after layer 11 are 25,000 at token 0 (an attention sink shared by every later boundary) and
    ~150 elsewhere: over [T, H] at once, boundaries 12..27 are 1-4% apart and a slot one layer off passed bf16's
    tolerance. Per token they are far apart, and the slot is named."""
    torch.manual_seed(0)
    T, H = 12, 32
    sink = torch.zeros(T, H)
    sink[0, 0] = 25_000.0
    here = {b: sink + 150 * torch.randn(T, H) / H ** 0.5 for b in range(4)}  # [T, H] per boundary
    frobenius = float((here[2] - here[1]).norm() / here[1].norm())
    assert frobenius < TOLERANCE[torch.bfloat16] / 2  # the old measure could not tell them apart
    engine = torch.stack([here[1], here[3]], dim=1)  # [T, 2, H]: slot "1" right, slot "2" holds boundary 3
    found = problems(check_slots(engine, [1, 2], here), TOLERANCE[torch.bfloat16], "vllm", 3)
    assert found == [found[0]] and found[0].startswith("vllm's state for boundary 2 is boundary 3 here")


def test_split_states_orders_aux_as_the_contract_and_takes_the_label_slot():
    T, H = 3, 4
    slots = [2, 5, 9, 12]
    states = torch.arange(T * len(slots) * H, dtype=torch.float32).reshape(T, len(slots), H)
    aux, last = split_states(states, slots, [9, 2, 5], 12)
    assert aux.shape == (T, 3 * H)
    assert torch.equal(aux[:, :H], states[:, 2]) and torch.equal(aux[:, H:2 * H], states[:, 0])
    assert torch.equal(last, states[:, 3])


class FakeEngine:
    """An engine handing the in-process states, shifted by ``shift`` boundaries from the first ``from_seq`` on."""

    def __init__(self, target, slots, shift=0):
        self.target, self.boundaries, self.shift, self.version = target, slots, shift, "fake 1.0"
        self.asked = []

    def states(self, ids):
        self.asked.append(ids)
        here = states_here(self.target, ids)
        L = self.target.num_layers
        return torch.stack([here[min(b + self.shift, L)] for b in self.boundaries], dim=1)


def _seqs(n):
    return [TokenizedConversation(id=f"c{i}", input_ids=TOKENS[: 6 + i], loss_mask=[0, 0, 1, 1, 1, 1] + [1] * i,
                                  num_assistant_turns=1, num_tokens_before_truncation=6 + i) for i in range(n)]


def test_engine_batch_checks_the_first_sequences_only_and_splits_the_rest(target):
    L = target.num_layers
    contract = HiddenStateContract(aux_boundaries=(1, 3), target=target.fingerprint)
    engine = FakeEngine(target, [1, 3, L])
    checked = {}
    out = list(engine_batch(engine, target, contract, _seqs(6), checked))
    assert checked[-1] == 4 and len(out) == 6 and sorted(checked) == [-1, 1, 3, L]
    assert all(checked[b] == 0.0 for b in (1, 3, L))  # the same states: no error
    seq, aux, last = out[5]
    here = states_here(target, list(seq.input_ids))
    assert torch.equal(aux, torch.cat([here[1], here[3]], dim=-1)) and torch.equal(last, here[L])
    with pytest.raises(EngineCaptureError, match="boundary 1 is boundary 2 here"):
        list(engine_batch(FakeEngine(target, [1, 3, L], shift=1), target, contract, _seqs(2), {}))


def test_vllm_capture_ids_flags_and_launch_line():
    assert vcap.capture_ids([2, 15, 27], 30, "LlamaForCausalLM") == [2, 15, 27, 30]
    flags = vcap.capture_flags([2, 30], vcap.Path("/s"))
    spec = json.loads(flags[flags.index("--speculative-config") + 1])
    assert spec == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 30]}}}
    kv = json.loads(flags[flags.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "CpuHiddenStatesConnector" and kv["kv_connector_module_path"] == vcap.CONNECTOR_MODULE
    assert (vcap.CONNECTOR_DIR / f"{vcap.CONNECTOR_MODULE}.py").is_file()
    gpu = vcap.kv_transfer_config(vcap.Path("/s"), vcap.GPU_CONNECTOR)
    assert gpu["kv_connector"] == "ExampleHiddenStatesConnector" and "kv_connector_module_path" not in gpu
    assert "--tensor-parallel-size" in vcap.capture_flags([2], vcap.Path("/s"), tensor_parallel=2)


def test_read_states_checks_the_tokens_and_slots_and_removes_the_file(tmp_path):
    path = tmp_path / "r.safetensors"

    def write(ids, slots):
        save_file({"hidden_states": torch.ones(len(ids), slots, 4), "token_ids": torch.tensor(ids)}, str(path))
        (tmp_path / "r.safetensors.lock").write_text("")

    write([1, 2, 3], 2)
    states = vcap.read_states(path, [1, 2, 3], 2)
    assert states.shape == (3, 2, 4) and not path.exists() and not (tmp_path / "r.safetensors.lock").exists()
    write([1, 2], 2)
    with pytest.raises(VllmError, match="other than the 3 sent"):
        vcap.read_states(path, [1, 2, 3], 2)
    write([1, 2, 3], 3)
    with pytest.raises(VllmError, match=r"not \[T, 2, H\]"):
        vcap.read_states(path, [1, 2, 3], 2)
    with pytest.raises(VllmError, match="not here"):
        vcap.read_states(tmp_path / "elsewhere.safetensors", [1], 1)


def test_prepare_refuses_an_engine_that_does_not_capture_and_a_url_without_an_engine(tmp_path):
    with pytest.raises(ValueError, match=r"--capture .llamacpp. is not one of sglang, vllm.*, or here"):
        PrepareConfig(out=str(tmp_path), capture="llamacpp")
    with pytest.raises(ValueError, match="--capture-url names a running engine's server: add --capture ENGINE"):
        PrepareConfig(out=str(tmp_path), capture_url="http://127.0.0.1:8000")
    PrepareConfig(out=str(tmp_path), capture="vllm")


class LastSlotFrom(FakeEngine):
    """An engine whose label slot (boundary L) holds boundary ``L - back``'s state: its last layer one off."""

    def __init__(self, target, slots, back):
        super().__init__(target, slots)
        self.back = back

    def states(self, ids):
        states = super().states(ids)  # [T, n, H]
        here = states_here(self.target, ids)
        states[:, -1] = here[self.target.num_layers - self.back]
        return states


def _capture_with(monkeypatch, engine):
    from contextlib import contextmanager

    @contextmanager
    def capture(self, target, boundaries, num_layers, arch, settings, *, work_dir, url=None):
        assert boundaries + [num_layers] == engine.boundaries  # head-only: boundary L-1 asked for too
        yield engine

    monkeypatch.setattr(vcap.VllmCapturer, "capture", capture)


def test_head_only_capture_loads_the_last_layer_only_and_checks_the_label_slot_with_it(tmp_path, smollm2_target,
                                                                                          monkeypatch):
    """A target too large for this process: only its last layer is read, the engine is asked for boundary L-1
    too, its label slot is checked as that layer applied to its boundary L-1, the manifest says so, and a label
    slot one layer early stops the run (the label check on the head alone lets SmolLM2's boundary 29 pass). The
    real SmolLM2 (in process, behind a fake engine): a random target's head cannot pass the label check's
    calibration rule."""
    import eaglewire.data.prepare as prepare_module
    from eaglewire.data.prepare import prepare
    from eaglewire.data.shards import ShardDataset

    data = tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
        {"role": "assistant", "content": f"It is {2 * i}, since {i} and {i} make {2 * i}. " * 3}]}) + "\n"
        for i in range(6)))

    def config(out, **kw):
        return PrepareConfig(**{"out": str(tmp_path / out), "data": str(data), "aux_boundaries": [2, 15], "max_length": 128, "batch_tokens": 256, "dtype": "fp32",
                                "device": "cpu", **kw})

    prepare(config("here"), target=smollm2_target, progress=False)
    L = smollm2_target.num_layers
    monkeypatch.setattr(prepare_module, "load_target", lambda *a, **k: pytest.fail("--head-only loaded the layers"))
    _capture_with(monkeypatch, FakeEngine(smollm2_target, [2, 15, L - 1, L]))
    prepare(config("engine", capture="vllm", head_only=True), progress=False)
    status = json.loads((tmp_path / "engine" / "manifest.json").read_text())["status"]
    check = status["capture_check"]
    assert check["sequences"] == 4 and list(check["max_relative_error"]) == [str(L)]
    assert check["max_relative_error"][str(L)] < 1e-4 and "last layer applied to its boundary L-1" in check["instead"]
    here, engine = ShardDataset(tmp_path / "here"), ShardDataset(tmp_path / "engine")
    assert len(engine) == len(here) == 6
    for a, b in zip(here, engine):  # batched (padded) here, one sequence at a time there: another summation order
        assert torch.equal(a["input_ids"], b["input_ids"])
        gap = (a["aux_hidden"].float() - b["aux_hidden"].float()).norm() / a["aux_hidden"].float().norm()
        assert gap < 1e-2, gap  # bf16 on disk: a state 1e-6 apart may round to the neighbouring bf16 value

    _capture_with(monkeypatch, LastSlotFrom(smollm2_target, [2, 15, L - 1, L], back=1))
    with pytest.raises(EngineCaptureError, match=f"state for boundary {L} .* is its own boundary {L - 1}"):
        prepare(config("wrong-last", capture="vllm", head_only=True), progress=False)
    assert not list((tmp_path / "wrong-last").glob("*.safetensors"))


def test_the_head_only_check_runs_the_last_layer_on_the_engines_own_boundary_before_it(target):
    """require_last_layer needs the embedding and the last layer only: a right engine passes, a label slot that
    is boundary L-1, a post-norm label slot and a boundary-0 slot that is not the embedding output stop it."""
    from eaglewire.data.engine_capture import require_last_layer

    L = target.num_layers
    slots = [0, 2, L - 1, L]
    states = engine_slots(target, slots)
    checks = require_last_layer(states + 1e-7, slots, target, TOKENS, "vllm 0.32.0", sequence="c1")
    assert [c.boundary for c in checks] == [L, 0] and all(c.own < 1e-5 for c in checks)
    early = states.clone()
    early[:, 3] = early[:, 2]
    with pytest.raises(EngineCaptureError, match=f"boundary {L} .* is its own boundary {L - 1}: the last layer was"):
        require_last_layer(early, slots, target, TOKENS, "vllm 0.32.0", sequence="c1")
    normed = states.clone()
    with torch.no_grad():
        normed[:, 3] = target.decoder.norm(normed[:, 3])
    with pytest.raises(EngineCaptureError, match=f"is not layer {L - 1} applied to its boundary {L - 1}"):
        require_last_layer(normed, slots, target, TOKENS, "vllm 0.32.0", sequence="c1")
    shifted = engine_slots(target, slots, shift=1)
    with pytest.raises(EngineCaptureError, match="boundary 0 is not the embedding output"):
        require_last_layer(shifted, slots, target, TOKENS, "vllm 0.32.0", sequence="c1")


def test_head_only_needs_an_engine_which_regenerates_too(tmp_path):
    """--head-only cannot compute states here, so it needs --capture ENGINE; --regenerate then goes through that
    engine's server (or --server's), never the target here."""
    with pytest.raises(ValueError, match="--head-only loads only the target's last layer.*add --capture ENGINE"):
        PrepareConfig(out=str(tmp_path), head_only=True)
    assert PrepareConfig(out=str(tmp_path), head_only=True, capture="vllm", regenerate=True).regenerates_through_capture
    assert not PrepareConfig(out=str(tmp_path), capture="vllm", regenerate=True,
                             remote=RemoteConfig(server=["http://127.0.0.1:1"])).regenerates_through_capture
