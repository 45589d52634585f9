"""A DFlash draft along a text: the trace of every anchored block (from one capture) is what decoding
drafts block by block, and the doctor's counts and round replay read it with decoding's alignment."""

import pytest
import torch

from eaglewire.acceptance.replay import compare_rounds
from eaglewire.acceptance.trace import top_probs, trace_blocks
from eaglewire.model.capture import capture
from eaglewire.model.dflash_blocks import block_judgements, mask_embedding, target_lm_head
from eaglewire.model.ttt import target_signal
from tiny import random_dflash_draft, tiny_target

V = 6


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", initializer_range=0.2, vocab_size=V)
    draft, contract = random_dflash_draft(target, block_size=4, num_layers=2, seed=1)
    text = torch.randint(0, V, (22,), generator=torch.Generator().manual_seed(3)).tolist()
    return target, draft, list(contract.aux_boundaries), text


def fused_prefix_states(target, layout, ids):
    """[1, p, k*H] the layout's states of a prefix, captured on the prefix alone (as a decoder has them)."""
    got = capture(target, torch.tensor([ids]), [b for b in layout if b != target.num_layers])
    return got.aux_hidden.float()


def decode_block(target, draft, layout, text, p, block_len):
    """What decoding drafts at anchor p: the context cache of x_0..x_{p-1}, then one block of
    ``block_len`` tokens -> (drafted ids [J], logits [J, V])."""
    emb = target.embed_tokens(torch.tensor([text])).float()  # [1, T, H]
    mask_emb = mask_embedding(draft, target.embed_tokens, emb.device)
    with torch.no_grad():
        ctx = draft.fuse(fused_prefix_states(target, layout, text[:p]))  # [1, p, H]
        cache = draft.context_kv(ctx, torch.arange(p)[None])
        if block_len == draft.config.block_size:
            hidden = draft.draft_block(emb[:, p], mask_emb, p, cache)[0]  # [J, H]
        else:  # llama.cpp's shorter block: [anchor, mask x (block_len - 1)], all attending to all
            block = torch.cat([emb[:, p:p + 1], mask_emb.expand(1, block_len - 1, -1)], dim=1)  # [1, bl, H]
            mask = torch.ones(1, 1, block_len, p + block_len, dtype=torch.bool)
            hidden = draft.forward_blocks(block, torch.arange(p, p + block_len)[None], cache, mask)[0, 1:]
        logits = target_lm_head(target)(hidden)  # [J, V]
    return logits.argmax(-1), logits


@pytest.mark.parametrize("block_len", [4, 2])
def test_the_trace_is_what_decoding_drafts_block_by_block(setup, block_len):
    """Column t of the trace is the block anchored at t + 1 decoded from a growing context cache: the
    same drafted tokens (judged against the text two plus position ahead) and the same probabilities."""
    target, draft, layout, text = setup
    trace = trace_blocks(target, draft, layout, text, 5, block_lens=[block_len])[block_len]
    J, T = block_len - 1, len(text)
    assert trace.right.shape == (J, T) and trace.block and trace.steps == J
    hits = 0
    for p in range(1, T - 1):
        drafted, logits = decode_block(target, draft, layout, text, p, block_len)
        inside = [p + j < T for j in range(1, J + 1)]
        expected = [inside[j] and int(drafted[j]) == text[p + 1 + j] for j in range(J)]
        assert trace.right[:, p - 1].tolist() == expected, p
        full, top = top_probs(logits)
        # one capture of the whole text against captures of each prefix: the same causal states,
        # computed over other shapes (summation order), so a tolerance
        torch.testing.assert_close(trace.prob[:, p - 1], full, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(trace.prob_top[:, p - 1], top, atol=1e-5, rtol=1e-4)
        hits += sum(expected)
    assert hits > 0  # some drafted tokens are right, so a shifted column would be seen


def test_greedy_target_prob_is_one_where_the_target_would_keep_the_draft(setup):
    target, draft, layout, text = setup
    trace = trace_blocks(target, draft, layout, text, 5)[4]
    logits = target.head(capture(target, torch.tensor([text]), [2]).last_hidden[0]).float()  # [T, V]
    for p in range(1, len(text) - 3):
        drafted, _ = decode_block(target, draft, layout, text, p, 4)
        for j in range(3):  # drafted position j + 1 is judged by the target at p + j
            assert float(trace.target_prob[j, p - 1]) == float(int(logits[p + j].argmax()) == int(drafted[j]))
