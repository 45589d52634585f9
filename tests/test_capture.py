import pytest
import torch

from eaglewire.model.boundary_capture import capture
from eaglewire.core.contract import ContractError
from tiny import ARCHITECTURES, tiny_target


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_capture_matches_hf_hidden_states(arch):
    target = tiny_target(arch)
    L, H = target.num_layers, target.hidden_size
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    bounds = [0, 2, 4, L - 1]  # ascending (engines feed layer order); concatenation follows the list
    got = capture(target, ids, bounds)
    ref = target.model(ids, output_hidden_states=True)
    assert got.aux_hidden.shape == (2, 12, len(bounds) * H)
    for i, b in enumerate(bounds):
        torch.testing.assert_close(got.aux_hidden[..., i * H:(i + 1) * H], ref.hidden_states[b],
                                   rtol=0, atol=0)
    # HF's hidden_states[L] is post-norm; boundary L is the pre-norm state before it.
    torch.testing.assert_close(target.decoder.norm(got.last_hidden), ref.hidden_states[L])
    assert not torch.allclose(got.last_hidden, ref.hidden_states[L])
    torch.testing.assert_close(target.head(got.last_hidden), ref.logits, rtol=1e-5, atol=1e-5)


def test_boundary_L_can_be_an_aux_state():
    target = tiny_target("qwen3")
    got = capture(target, torch.arange(10)[None], [3, target.num_layers])
    torch.testing.assert_close(got.aux_hidden[..., target.hidden_size:], got.last_hidden)


def test_padded_batch_equals_single_sequences():
    target = tiny_target("llama")
    a, b = torch.arange(3, 13), torch.arange(20, 26)
    ids = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.zeros(2, 10, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, :6], mask[1, :6] = b, 1  # right padding
    batch = capture(target, ids, [2, 5], attention_mask=mask)
    single = capture(target, b[None], [2, 5])
    torch.testing.assert_close(batch.aux_hidden[1, :6], single.aux_hidden[0], rtol=1e-5, atol=1e-5)


def test_capture_rejects_bad_input():
    target = tiny_target("llama")
    with pytest.raises(ContractError, match=r"9 is outside \[0, 8\]"):
        capture(target, torch.arange(5)[None], [2, 9])
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        capture(target, torch.arange(5), [2, 4])


def test_hooks_are_removed():
    target = tiny_target("llama")
    capture(target, torch.arange(5)[None], [0, 2, 8])
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in target.layers)


@pytest.mark.real
def test_capture_on_real_smollm2(smollm2_target):
    target = smollm2_target
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    ids = target.tokenizer("The capital of France is", return_tensors="pt").input_ids
    got = capture(target, ids, [2, 15, 27])
    ref = target.model(ids, output_hidden_states=True)
    torch.testing.assert_close(got.aux_hidden[..., 576:1152], ref.hidden_states[15], rtol=0, atol=0)
    logits = target.head(got.last_hidden)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-4)
    # The dequantized, cached target is a working language model.
    assert target.tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"
