"""Greedy speculative decoding in bf16 equals plain bf16 decoding token for token.

In bf16 one ulp of a hidden state flips later greedy tokens, and two kernels differ by an ulp
when a row's result depends on how many rows a call computes: oneDNN's GEMM takes another
kernel for one row than for several when K is large (the down projection, K = the MLP width),
and the fused attention kernel's result for a row depends on the block. The lean runner
computes a verify's rows exactly as plain steps do (gemm.PackedLinear.exact_rows,
runner.attend_rows); these tests hold that on the machine they run on."""

import pytest
import torch
import transformers

from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
from eaglewire.decode.gemm import PackedLinear, onednn_available
from eaglewire.decode.attention import attend, attend_rows, block_rows
from eaglewire.model.target import target_from_config
from test_spec_decoder import oracle_trees, random_draft


def wide_bf16_target():
    """A Llama whose MLP is as wide as a real one's (K = 2048 in the down projection), in bf16."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=2048, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      initializer_range=0.2)
    return target_from_config(config, dtype=torch.bfloat16)


@pytest.mark.parametrize("onednn", [None, False])  # None: oneDNN where it runs bf16 here; False: x @ w
@pytest.mark.parametrize("rows", [2, 4, 8, 33])
@pytest.mark.parametrize("K, M", [(576, 49152 // 16), (1536, 576), (2048, 64), (4096, 1024)])
def test_an_exact_rows_linear_gives_each_row_what_a_one_row_call_gives(rows, K, M, onednn):
    g = torch.Generator().manual_seed(K + M)
    layer = PackedLinear(torch.randn(M, K, generator=g) * 0.05, dtype=torch.bfloat16, exact_rows=True, onednn=onednn)
    x = torch.randn(rows, K, generator=g).bfloat16()  # [N, K]
    one_by_one = torch.cat([layer(x[r:r + 1]) for r in range(rows)])  # [N, M]
    assert torch.equal(layer(x), one_by_one)
    assert torch.equal(layer(x[0]), one_by_one[0])  # an unbatched row [K] too


@pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.bfloat16), reason="oneDNN runs no bf16 GEMM here (an AVX2-only CPU)")
def test_an_exact_rows_linear_computes_what_the_plain_one_computes_for_several_rows():
    w = torch.randn(64, 2048, generator=torch.Generator().manual_seed(1))
    x = torch.randn(4, 2048).bfloat16()
    assert torch.equal(PackedLinear(w, dtype=torch.bfloat16, exact_rows=True)(x),
                       PackedLinear(w, dtype=torch.bfloat16)(x))


def test_attention_row_by_row_is_each_row_alone():
    """A tree block: row r sees the prefix and the block rows the mask gives it."""
    g = torch.Generator().manual_seed(0)
    P, N, nH, nKV, hd = 11, 5, 4, 2, 16
    q = torch.randn(nH, N, hd, generator=g).bfloat16()
    k, v = (torch.randn(nKV, P + N + 3, hd, generator=g).bfloat16() for _ in range(2))  # the cache, 3 rows spare
    parents = [-1, 0, 0, 1, 2]  # a tree: root, two children, a grandchild under each
    mask = torch.zeros(N, P + N, dtype=torch.bool)
    mask[:, :P] = True
    for r in range(N):
        a = r
        while a >= 0:
            mask[r, P + a] = True
            a = parents[a]
    rows = block_rows(mask, P, N)
    assert rows[0] is None and rows[1] is None and rows[2].tolist() == [0, 2] and rows[4].tolist() == [0, 2, 4]
    got = attend_rows(q, k, v, P, rows, 0.25)  # [nH, N, hd]
    for r in range(N):
        seen = mask[r].nonzero().flatten()
        want = attend(q[:, r:r + 1], k[:, seen], v[:, seen], None, 0.25)  # [nH, 1, hd]
        assert torch.equal(got[:, r:r + 1], want), f"row {r}"
    assert block_rows(None, P, 3) == [None] * 3  # causal: every row a chain's


@pytest.mark.parametrize("accept_prob", [0.7, 1.0])
def test_greedy_speculation_in_bf16_equals_plain_bf16(accept_prob):
    target = wide_bf16_target()
    draft, contract = random_draft(target, bounds=(1, 2, 3))
    draft = draft.to(torch.bfloat16)
    for seed in range(3):
        prompt = torch.randint(0, 256, (40 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain, _ = SpecDecoder(target).generate(prompt, max_new_tokens=48)
        for spec in (SpecConfig(num_steps=4, topk=1, num_draft_tokens=5), SpecConfig(num_steps=4, topk=2,
                                                                                       num_draft_tokens=9)):
            decoder = SpecDecoder(target, draft, contract, spec)
            oracle_trees(decoder, plain, len(prompt), accept_prob, seed)
            out, _ = decoder.generate(prompt, max_new_tokens=48)
            assert out == plain, f"seed {seed}, {spec}"
