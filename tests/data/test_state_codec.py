"""The compact-state codec: fp8 aux states with per-token, per-boundary scales, top-K labels."""

from __future__ import annotations

import pytest
import torch

from eaglewire.data.state_codec import (FP8_MAX, dequantise_fp8, id_dtype, label_positions, parse_labels,
                                        quantise_fp8, topk_labels)

T, K, H = 50, 3, 64


def states(seed: int = 0) -> torch.Tensor:
    """[T, K*H] with magnitudes spread over six orders across tokens and boundaries, and outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, H, generator=g) * torch.logspace(-3, 3, T * K).reshape(T, K, 1)  # [T, K, H]
    x[:, :, 0] *= 40  # an outlier channel, as real residual streams have
    x[3] = 0.0  # an all-zero token
    return x.reshape(T, K * H)


def test_round_trip_is_within_a_sixteenth_of_each_tokens_boundary_amax():
    """e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most 2^-4 of it,
    a subnormal by at most 2^-10 of the scale. So |x - x'| <= 2^-4 * amax(token, boundary); the
    brief's 2^-3 (one unit in the last place) holds with room. Read back in fp32 to test the
    codec alone (bf16, the reader's default, adds its own 2^-9 relative rounding)."""
    x = states()
    q, scale = quantise_fp8(x, K)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (T, K * H)
    assert scale.dtype == torch.float32 and scale.shape == (T, K)
    back = dequantise_fp8(q, scale, torch.float32)
    amax = x.reshape(T, K, H).abs().amax(-1, keepdim=True)  # [T, K, 1]
    err = (back - x).reshape(T, K, H).abs()  # [T, K, H]
    assert (err <= 2 ** -4 * amax).all()
    assert (err <= 2 ** -3 * amax).all()
    # elementwise, relative to the value itself where it is normal in e4m3 (scaled |x| >= 2^-6)
    normal = x.reshape(T, K, H).abs() / scale[..., None] >= 2 ** -6
    assert (err[normal] <= 2 ** -4 * x.reshape(T, K, H).abs()[normal]).all()
    assert torch.equal(back[3], torch.zeros(K * H))  # zero stays zero (scale 1, no division by 0)


def test_the_largest_element_maps_to_448_and_returns_up_to_fp32_rounding():
    x = states(1)
    q, scale = quantise_fp8(x, K)
    blocks = q.float().reshape(T, K, H).abs()
    nonzero = x.reshape(T, K, H).abs().amax(-1) > 0  # [T, K]
    assert torch.equal(blocks.amax(-1)[nonzero], torch.full((int(nonzero.sum()),), FP8_MAX))
    back = dequantise_fp8(q, scale, torch.float32).reshape(T, K, H)
    assert torch.allclose(back.abs().amax(-1), x.reshape(T, K, H).abs().amax(-1), rtol=1e-6)


def test_each_boundary_has_its_own_scale():
    """A boundary 1000x larger than another (the last layers' residual stream) does not wash out the small one."""
    x = torch.randn(4, K * H)
    x[:, H:2 * H] *= 1000
    q, scale = quantise_fp8(x, K)
    back = dequantise_fp8(q, scale, torch.float32)
    small = slice(0, H)
    assert ((back[:, small] - x[:, small]).abs() <= 2 ** -4 * x[:, small].abs().amax(-1, keepdim=True)).all()


def test_dequantise_reads_back_in_bf16_by_default():
    q, scale = quantise_fp8(states(), K)
    assert dequantise_fp8(q, scale).dtype == torch.bfloat16


def test_topk_labels_are_the_largest_log_probabilities_sorted():
    logits = torch.randn(7, 100)
    values, ids = topk_labels(logits, 5)
    full = torch.log_softmax(logits, -1)
    assert torch.equal(ids, full.argsort(-1, descending=True)[:, :5])
    assert torch.allclose(values, full.gather(1, ids))
    assert (values[:, :-1] >= values[:, 1:]).all()


def test_label_positions_are_the_tokens_before_reply_tokens():
    mask = torch.tensor([0, 0, 1, 1, 0, 1], dtype=torch.uint8)
    assert label_positions(mask).tolist() == [False, True, True, False, True, False]


@pytest.mark.parametrize("spec, want", [("hidden", ("hidden", None)), ("topk:32", ("topk", 32))])
def test_parse_labels(spec, want):
    assert parse_labels(spec) == want


@pytest.mark.parametrize("spec, message", [("topk", "not a labels mode"), ("topk:0", "K >= 1"),
                                           ("last", "hidden"), ("topk:300", "exceeds the target vocabulary")])
def test_bad_labels_name_the_flag(spec, message):
    with pytest.raises(ValueError, match=f"--labels.*{message}"):
        parse_labels(spec, vocab_size=256)


def test_ids_take_two_bytes_while_the_vocab_fits():
    assert id_dtype(49152) == torch.uint16 and id_dtype(1 << 16) == torch.uint16
    assert id_dtype(163840) == torch.int32
