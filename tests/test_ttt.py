import pytest
import torch

from eaglewire.model.draft import DraftConfig, Eagle3Draft
from eaglewire.model.ttt import (StepCounts, TargetSignal, counted_per_step, shift_left, signal_positions, target_signal,
                                 ttt_loss, ttt_unroll)

V, VD, T = 16, 16, 10


def tiny_draft():
    torch.manual_seed(0)
    return Eagle3Draft(DraftConfig(hidden_size=16, target_hidden_size=16, num_aux=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=8, intermediate_size=32, vocab_size=V,
                                   draft_vocab_size=VD))


def signal(in_vocab=None):
    probs = torch.full((1, T, VD), 1.0 / VD)
    argmax = torch.zeros(1, T, dtype=torch.long)
    return TargetSignal(probs=probs, argmax=argmax,
                        in_vocab=torch.ones(1, T, dtype=torch.bool) if in_vocab is None else in_vocab)


def run(loss_mask, sig, steps=3):
    draft = tiny_draft()
    emb, aux = torch.randn(1, T, 16), torch.randn(1, T, 32)
    return ttt_unroll(draft, emb, aux, loss_mask, sig, ttt_steps=steps)


def test_shift_left():
    x = torch.arange(5)[None]
    assert shift_left(x, 2).tolist() == [[2, 3, 4, 0, 0]]
    assert shift_left(x, 0) is x
    assert shift_left(x, -2).tolist() == [[0, 0, 0, 1, 2]]
    assert shift_left(x, 5).tolist() == shift_left(x, -5).tolist() == [[0, 0, 0, 0, 0]]


def test_prediction_of_token_m_is_counted_once_per_step():
    """Token x_m under the loss mask is predicted at step j from position m - 2 - j."""
    m = 8
    loss_mask = torch.zeros(1, T, dtype=torch.bool)
    loss_mask[0, m] = True
    _, counts = run(loss_mask, signal())
    assert [c.valid for c in counts] == [1, 1, 1]
    # The target's view of x_m lives at index m - 1; outside the draft vocab, it is dropped at every step.
    in_vocab = torch.ones(1, T, dtype=torch.bool)
    in_vocab[0, m - 1] = False
    _, counts = run(loss_mask, signal(in_vocab))
    assert [c.valid for c in counts] == [0, 0, 0]


def test_tokens_near_the_start_have_fewer_steps():
    loss_mask = torch.zeros(1, T, dtype=torch.bool)
    loss_mask[0, 3] = True  # predicted from positions 1 (step 0) and 0 (step 1) only
    _, counts = run(loss_mask, signal())
    assert [c.valid for c in counts] == [1, 1, 0]


def test_loss_is_soft_cross_entropy_weighted_by_decay():
    loss_mask = torch.ones(1, T, dtype=torch.bool)
    loss, counts = run(loss_mask, signal(), steps=2)
    expected = counts[0].loss + 0.8 * counts[1].loss
    assert abs(loss.item() - expected) < 1e-4
    assert counts[0].valid == T - 2 and counts[1].valid == T - 3


def test_conditional_accuracy_counts_only_positions_right_so_far():
    a = StepCounts(valid=10, correct=5, cond_valid=4, cond_correct=2, loss_sum=3.0)
    a.add(StepCounts(valid=10, correct=5, cond_valid=4, cond_correct=4, loss_sum=1.0))
    assert (a.acc, a.cond_acc, a.loss) == (0.5, 0.75, 0.2)


def test_target_signal_chunks_match_one_pass():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 20)
    last = torch.randn(2, 7, 8)
    draft_ids = torch.tensor([1, 4, 5, 9])
    t2d = torch.zeros(20, dtype=torch.bool)
    t2d[draft_ids] = True
    a = target_signal(head, last, draft_ids, t2d, chunk_tokens=3)
    logits = head(last)
    torch.testing.assert_close(a.probs, torch.softmax(logits[..., draft_ids], -1))
    assert torch.equal(a.argmax, logits.argmax(-1)) and torch.equal(a.in_vocab, t2d[logits.argmax(-1)])


def test_signal_only_where_needed_leaves_the_unrolled_loss_and_counts_unchanged():
    """The head runs only at indices whose next token is under the loss mask; every TTT step
    reads the signal only there, so loss and counts equal those of the full signal."""
    torch.manual_seed(1)
    head = torch.nn.Linear(16, V)
    last = torch.randn(2, T, 16)
    draft_ids = torch.arange(VD)
    t2d = torch.rand(V) < 0.7  # some target argmaxes fall outside the draft vocabulary
    loss_mask = torch.rand(2, T) < 0.6
    needed = signal_positions(loss_mask)
    assert needed.sum() < needed.numel()  # not vacuous: some indices are skipped
    full = target_signal(head, last, draft_ids, t2d)
    part = target_signal(head, last, draft_ids, t2d, needed, chunk_tokens=3)
    assert not part.in_vocab[~needed].any() and (part.probs[~needed] == 0).all()
    draft, emb, aux = tiny_draft(), torch.randn(2, T, 16), torch.randn(2, T, 32)
    with torch.no_grad():
        a_loss, a_counts = ttt_unroll(draft, emb, aux, loss_mask, full, ttt_steps=3)
        b_loss, b_counts = ttt_unroll(draft, emb, aux, loss_mask, part, ttt_steps=3)
    torch.testing.assert_close(a_loss, b_loss)
    assert a_counts[0].valid > 0
    for a, b in zip(a_counts, b_counts, strict=True):
        # The counts are integers and must agree exactly; loss_sum is a float sum whose order
        # differs between the full and the chunked signal (and between AVX2 and AVX-512
        # kernels), so it agrees only to rounding.
        assert (a.valid, a.correct, a.cond_valid, a.cond_correct) == (b.valid, b.correct, b.cond_valid, b.cond_correct)
        assert a.loss_sum == pytest.approx(b.loss_sum, rel=1e-5)


def _rows(sig: TargetSignal, rows: slice) -> TargetSignal:
    return TargetSignal(probs=sig.probs[rows], argmax=sig.argmax[rows], in_vocab=sig.in_vocab[rows])


@pytest.mark.parametrize("dense", [False, True])
def test_parts_normalised_by_the_whole_batch_add_up_to_the_whole_batch(dense):
    """Micro-batches (or ranks) given the whole step's counts as normalizers: their losses and
    gradients add up to those of one batch holding all their rows, however unevenly the rows
    count positions (here 2 rows with few, 2 with many); with the counted positions selected or masked."""
    torch.manual_seed(2)
    head = torch.nn.Linear(16, V)
    sig = target_signal(head, torch.randn(4, T, 16), torch.arange(VD), torch.rand(V) < 0.8)
    loss_mask = torch.zeros(4, T, dtype=torch.bool)
    loss_mask[:2, -3:] = True
    loss_mask[2:, 2:] = True
    emb, aux = torch.randn(4, T, 16), torch.randn(4, T, 32)

    whole_draft, parts_draft = tiny_draft(), tiny_draft()
    whole, _ = ttt_loss(whole_draft, emb, aux, loss_mask, sig, ttt_steps=3, dense=dense)
    whole.backward()
    normalizers = counted_per_step(loss_mask, sig.in_vocab, 3)  # [3]
    halves = (slice(0, 2), slice(2, 4))
    assert (counted_per_step(loss_mask[:2], sig.in_vocab[:2], 3).tolist()
            != counted_per_step(loss_mask[2:], sig.in_vocab[2:], 3).tolist())
    total = 0.0
    for rows in halves:
        part, _ = ttt_loss(parts_draft, emb[rows], aux[rows], loss_mask[rows], _rows(sig, rows), ttt_steps=3,
                           normalizers=normalizers, dense=dense)
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, whole.detach())
    for a, b in zip(whole_draft.parameters(), parts_draft.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_topk_signal_with_the_whole_vocab_equals_the_heads_signal():
    """Stored top-V log-probabilities carry the full distribution: renormalised over the draft vocab
    they are the softmax of the logits there (log-softmax only shifts logits by a constant)."""
    from eaglewire.model.ttt import topk_signal

    torch.manual_seed(0)
    Vt, B = 40, 2
    logits = torch.randn(B, T, Vt) * 3  # [B, T, V]
    t2d = torch.zeros(Vt, dtype=torch.bool)
    t2d[torch.randperm(Vt)[:12]] = True
    draft_ids = t2d.nonzero().squeeze(1)
    needed = torch.rand(B, T) > 0.3
    ref = target_signal(lambda h: h, logits, draft_ids, t2d, needed)
    values, ids = torch.log_softmax(logits, -1).topk(Vt, -1)  # [B, T, V] each
    got = topk_signal(values, ids, draft_ids, t2d, needed)
    assert torch.allclose(got.probs, ref.probs, atol=1e-6)  # fp32 softmax of shifted logits
    assert torch.equal(got.argmax[needed], ref.argmax[needed]) and torch.equal(got.in_vocab, ref.in_vocab)
    assert 0 < int(got.in_vocab.sum()) < int(needed.sum())  # some top-1 ids fall outside the draft vocab


def test_topk_signal_renormalises_the_stored_ids_inside_the_draft_vocab():
    from eaglewire.model.ttt import topk_signal

    t2d = torch.tensor([True, False, True, True, False])  # draft ids 0, 1, 2 = target ids 0, 2, 3
    draft_ids = t2d.nonzero().squeeze(1)
    ids = torch.tensor([[[3, 1, 0], [1, 2, 4]]])  # [1, 2, 3]
    logprobs = torch.log(torch.tensor([[[0.5, 0.3, 0.1], [0.6, 0.2, 0.1]]]))
    got = topk_signal(logprobs, ids, draft_ids, t2d, torch.ones(1, 2, dtype=torch.bool))
    # position 0: ids 3 and 0 are inside, 1 is not: 0.5 and 0.1 renormalised
    assert torch.allclose(got.probs[0, 0], torch.tensor([0.1 / 0.6, 0.0, 0.5 / 0.6]))
    assert got.argmax[0].tolist() == [3, 1] and got.in_vocab[0].tolist() == [True, False]  # top-1 id 1 is outside
    assert torch.allclose(got.probs[0, 1], torch.tensor([0.0, 1.0, 0.0]))  # only id 2 inside
