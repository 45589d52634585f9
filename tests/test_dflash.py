"""The DFlash draft and its training objective: what a block sees, training's parallel blocks equal
decoding's single block, anchors, counts and a loss that learns."""

import pytest
import torch

from eaglewire.model.dflash import DFlashConfig, DFlashDraft, block_attention_mask, default_mask_token_id
from eaglewire.model.dflash_objective import (block_loss, block_signal, block_tokens, label_indices,
                                              position_weights, sample_anchors)

V, H, T = 32, 16, 12


def tiny(block_size=4, layers=2, seed=0):
    torch.manual_seed(seed)
    return DFlashDraft(DFlashConfig(hidden_size=H, target_hidden_size=H, num_aux=2, num_hidden_layers=layers,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
                                    vocab_size=V, block_size=block_size, mask_token_id=V - 1))


def test_block_mask_sees_context_before_its_anchor_and_its_own_block_only():
    anchors = torch.tensor([[2, 5]])
    keep = torch.tensor([[True, True]])
    m = block_attention_mask(anchors, keep, context_len=8, block_size=3)[0, 0]  # [6, 8 + 6]
    assert m.shape == (6, 14)
    for q in range(6):
        n = q // 3
        a = anchors[0, n].item()
        assert m[q, :8].tolist() == [k < a for k in range(8)]
        assert m[q, 8:].tolist() == [k // 3 == n for k in range(6)]
    dropped = block_attention_mask(anchors, torch.tensor([[True, False]]), 8, 3)[0, 0]
    assert not dropped[3:, :8].any() and dropped[3:, 11:].all()  # a dropped block: its own block only, finite


def test_training_blocks_equal_decoding_one_block():
    """A block anchored at a in training (all T context states given, the mask hiding those from a
    on) computes what decoding computes from the context cache of x_0..x_{a-1} alone."""
    draft = tiny().eval()
    cfg = draft.config
    ids = torch.randint(0, V - 1, (1, T))
    aux = torch.randn(1, T, 2 * H)
    emb_table = torch.randn(V, H)
    anchors, keep = torch.tensor([[3, 7]]), torch.tensor([[True, True]])
    block_ids, pos = block_tokens(ids, anchors, keep, cfg.block_size, cfg.mask_token_id)
    ctx = draft.fuse(aux)
    out = draft.forward_blocks(emb_table[block_ids], pos, draft.context_kv(ctx, torch.arange(T)[None]),
                               block_attention_mask(anchors, keep, T, cfg.block_size))  # [1, 8, H]
    for n, a in enumerate([3, 7]):
        cache = draft.context_kv(ctx[:, :a], torch.arange(a)[None])
        one = draft.draft_block(emb_table[ids[:, a]], emb_table[cfg.mask_token_id], a, cache)  # [1, bs-1, H]
        # Same math, other shapes: SDPA sums over a different number of (masked) keys.
        torch.testing.assert_close(one, out[:, n * 4 + 1:(n + 1) * 4], atol=1e-5, rtol=1e-4)


def test_anchors_are_distinct_supervised_pairs():
    loss_mask = torch.zeros(2, T, dtype=torch.bool)
    loss_mask[0, 4:10] = True
    loss_mask[1, 2:4] = True  # one candidate only: anchor 2
    anchors, keep = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 4)
    row0 = anchors[0][keep[0]].tolist()
    assert len(set(row0)) == 4 and all(4 <= a <= 8 for a in row0) and row0 == sorted(row0)
    assert anchors[1][keep[1]].tolist() == [2] and keep[1].sum() == 1
    empty = sample_anchors(torch.zeros(1, T, dtype=torch.bool), 4)
    assert empty[0].shape == (1, 0)


def test_labels_are_the_next_tokens_under_the_mask():
    loss_mask = torch.zeros(1, T, dtype=torch.bool)
    loss_mask[0, 5:9] = True
    idx, counted = label_indices(torch.tensor([[6, 10]]), torch.tensor([[True, True]]), loss_mask, block_size=4)
    # anchor 6 drafts x7, x8, x9 (signals at 6, 7, 8): x9 is not supervised; anchor 10 runs off the end
    assert idx[0, 0].tolist() == [6, 7, 8]
    assert counted[0, 0].tolist() == [True, True, False]
    assert counted[0, 1].tolist() == [False, False, False]


def test_position_weights_decay_from_one():
    w = position_weights(5, gamma=4.0)
    assert len(w) == 4 and w[0] == 1.0 and all(a > b for a, b in zip(w, w[1:]))


def _greedy_batch(seed=0):
    """A toy 'target': token t+1 = (t + 1) mod (V-1), so the target's argmax at t is x_{t+1}."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, V - 1, (4, 1), generator=g)
    ids = (start + torch.arange(T)) % (V - 1)  # [4, T]
    probs = torch.nn.functional.one_hot((ids + 1) % (V - 1), V).float()  # [4, T, V]
    return ids, torch.ones(4, T, dtype=torch.bool), probs


def test_block_loss_learns_and_counts_per_position():
    ids, loss_mask, probs = _greedy_batch()
    draft = tiny(block_size=4, layers=1)
    emb = torch.nn.Embedding(V, H)
    head = torch.nn.Linear(H, V, bias=False)
    aux = torch.nn.functional.one_hot(ids, 2 * H).float()  # the fused state says which token is here
    lp = probs.clamp(min=1e-9).log()
    top = torch.topk(lp, 4, dim=-1)
    opt = torch.optim.Adam(list(draft.parameters()) + list(head.parameters()), lr=1e-2)
    first = None
    for step in range(60):
        sig = block_signal(loss_mask, anchors_per_row=6, block_size=4, topk=(top.values, top.indices),
                           vocab_size=V, generator=torch.Generator().manual_seed(step))
        loss, counts = block_loss(draft, emb, head, ids, aux, sig, gamma=4.0)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert [c.valid for c in counts] == sig.per_position()
    assert all(c.cond_valid <= c.valid for c in counts) and counts[0].cond_valid == counts[0].valid
    assert loss.item() < 0.3 * first
    assert counts[0].acc > 0.9  # the next token is learnable from the context alone


def test_stored_top_k_and_head_on_last_state_give_the_same_signal():
    loss_mask = torch.ones(2, T, dtype=torch.bool)
    head = torch.nn.Linear(H, V, bias=False)
    last = torch.randn(2, T, H)
    logp = torch.log_softmax(head(last), -1)
    top = torch.topk(logp, V, dim=-1)  # K = V: nothing dropped
    a = block_signal(loss_mask, anchors_per_row=3, block_size=4, head=head, last_hidden=last, vocab_size=V,
                     generator=torch.Generator().manual_seed(1))
    b = block_signal(loss_mask, anchors_per_row=3, block_size=4, topk=(top.values, top.indices), vocab_size=V,
                     generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.anchors, b.anchors) and torch.equal(a.argmax, b.argmax)
    assert a.label_ids is None and b.label_ids.shape == (len(b.argmax), V)  # dense vs K columns
    logits = torch.randn(len(a.argmax), V)
    # softmax of log-softmax, summed in another order: rounding only
    torch.testing.assert_close(a.cross_entropy(0, logits), b.cross_entropy(0, logits), atol=1e-5, rtol=1e-5)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="block_size"):
        DFlashConfig(hidden_size=H, target_hidden_size=H, num_aux=1, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=8, intermediate_size=32, vocab_size=V, block_size=1,
                     mask_token_id=0)
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig(hidden_size=H, target_hidden_size=H, num_aux=1, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=8, intermediate_size=32, vocab_size=V, block_size=4,
                     mask_token_id=V)


def test_default_mask_token_is_unused():
    class Tok:
        def __init__(self, n, specials, template=""):
            self.n, self.chat_template = n, template
            self.bos_token_id, self.eos_token_id, self.pad_token_id, self.mask_token_id = 1, 2, None, None
            self.added_tokens_decoder = {i: type("T", (), {"special": True, "__str__": lambda s, i=i: f"<s{i}>"})()
                                         for i in specials}

        def __len__(self):
            return self.n

    assert default_mask_token_id(Tok(30, [0, 1, 2]), 32) == 30  # a padded row past the tokenizer
    assert default_mask_token_id(Tok(32, [0, 1, 2, 5, 7]), 32) == 7
    assert default_mask_token_id(Tok(32, [0, 1, 2, 5, 7], template="<s7> ..."), 32) == 5
    with pytest.raises(ValueError, match="--mask-token-id"):
        default_mask_token_id(Tok(32, [1, 2]), 32)
