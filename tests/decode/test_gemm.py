import pytest
import torch

from eaglewire.decode.gemm import PackedLinear, onednn_available, pack_linears
from eaglewire.model.draft import DraftConfig, Eagle3Draft


@pytest.mark.parametrize("onednn", [False, pytest.param(True, marks=pytest.mark.skipif(
    not onednn_available(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN"))])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_x_times_w_transposed(onednn, bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g)  # [M, K]
    b = torch.randn(40, generator=g) if bias else None
    layer = PackedLinear(w, b, onednn=onednn)
    for shape in [(1, 24), (8, 24), (33, 24), (2, 5, 24)]:
        x = torch.randn(*shape, generator=g)
        want = torch.nn.functional.linear(x, w, b)
        got = layer(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_linear_casts_the_weight_once():
    w = torch.randn(8, 4, dtype=torch.float64)
    layer = PackedLinear(w, dtype=torch.float32, onednn=False)
    assert layer.weight.dtype == torch.float32 and layer(torch.ones(2, 4)).dtype == torch.float32



def test_pack_linears_keeps_the_math_and_leaves_the_original_alone():
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig(hidden_size=32, target_hidden_size=48, num_aux=3, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=64,
                                    draft_vocab_size=32)).eval()
    packed = pack_linears(draft)
    assert isinstance(draft.fc, torch.nn.Linear) and not isinstance(packed.fc, torch.nn.Linear)
    aux, emb = torch.randn(1, 5, 3 * 48), torch.randn(1, 5, 32)  # [B, T, k*Ht], [B, T, H]
    pos = torch.arange(5)[None]
    with torch.no_grad():
        want, wk, _ = draft.forward_cached(emb, draft.fuse(aux), pos, None, None, None)
        got, gk, _ = packed.forward_cached(emb, packed.fuse(aux), pos, None, None, None)
        torch.testing.assert_close(packed.logits(got), draft.logits(want), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gk, wk, rtol=1e-4, atol=1e-5)
