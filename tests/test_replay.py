"""The greedy-chain replay: the engine accepts, round by round, what the training-time unroll
says it would; a decoding path that feeds the draft anything else does not."""

import pytest
import torch

from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
from eaglewire.doctor.measure import engine_agreement
from eaglewire.acceptance.replay import accepted_after, compare_rounds, round_starts
from eaglewire.doctor.doctor_command import MIN_ROUND_AGREEMENT
from tiny import ARCHITECTURES, tiny_target

from decode.test_spec_decoder import random_draft


def test_accepted_after_counts_the_leading_right_steps():
    right = torch.tensor([[1, 1, 0, 1],
                          [1, 0, 1, 1],
                          [0, 1, 1, 1]], dtype=torch.bool)  # [S=3, T=4]
    assert [accepted_after(right, t) for t in range(4)] == [2, 1, 0, 3]


def test_round_starts_move_on_by_accepted_plus_bonus():
    assert round_starts(5, [1, 3, 2]) == [5, 6, 9]


def test_compare_rounds_judges_each_round_at_its_own_start():
    S, T = 2, 12
    right = torch.zeros(S, T, dtype=torch.bool)
    right[:, 4] = True  # the round whose root is at 5 accepts both drafts
    right[0, 7] = True  # the round at 8 accepts one
    # Engine: rounds at 5 (3 tokens), 8 (2), 10 (window 10 + 2 reaches past T: not compared).
    got = compare_rounds(right, 5, [3, 2, 1])
    assert (got.rounds, got.agree, got.measured_tokens, got.replayed_tokens) == (2, 2, 5, 5)
    # Rounds at 5 (rejects what training accepts), 6 (accepts what it rejects), 8 (agrees).
    got = compare_rounds(right, 5, [1, 2, 2])
    assert (got.rounds, got.agree) == (3, 1) and got.replayed_tau == pytest.approx((3 + 1 + 2) / 3)


def _engine(arch, steps=3):
    target = tiny_target(arch, initializer_range=0.2, vocab_size=6)
    draft, contract = random_draft(target)
    decoder = SpecDecoder(target, draft, contract, SpecConfig(num_steps=steps, topk=1, num_draft_tokens=steps + 1))
    return draft, contract, decoder


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_engine_accepts_what_the_unroll_predicts(arch):
    draft, contract, decoder = _engine(arch)
    accepted = 0
    for seed in range(2):
        prompt = torch.randint(0, 6, (6 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        got = engine_agreement(decoder, draft, list(contract.aux_boundaries), prompt, max_new_tokens=24)
        assert got.rounds >= 5 and got.agree == got.rounds, (arch, seed, got)
        accepted += got.measured_tokens - got.rounds
    assert accepted > 0  # not only rounds that reject everything


def test_a_miswired_decoding_path_disagrees_with_the_unroll():
    """The engine feeds the draft the states of the token before each accepted one (an
    off-by-one in the feedback): output is unchanged, acceptance is not what training predicts."""
    draft, contract, decoder = _engine("llama")
    extend, previous = decoder.drafter.extend, {}

    def off_by_one(aux, next_tokens, start):
        if start == 0:  # prefill: a new request
            previous["row"] = torch.zeros_like(aux[:1])
        shifted = torch.cat([previous["row"], aux[:-1]])  # [n, k*H]: the states of t-1 at t
        previous["row"] = aux[-1:]
        return extend(shifted, next_tokens, start)

    decoder.drafter.extend = off_by_one
    agree = rounds = 0
    for seed in range(3):
        prompt = torch.randint(0, 6, (6 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        got = engine_agreement(decoder, draft, list(contract.aux_boundaries), prompt, max_new_tokens=24)
        agree, rounds = agree + got.agree, rounds + got.rounds
    assert agree < MIN_ROUND_AGREEMENT * rounds, (agree, rounds)  # the doctor fails it


def test_the_replay_needs_a_chain():
    target = tiny_target("llama", vocab_size=6)
    draft, contract = random_draft(target)
    decoder = SpecDecoder(target, draft, contract, SpecConfig(num_steps=2, topk=2, num_draft_tokens=4))
    with pytest.raises(ValueError, match="topk 1"):
        engine_agreement(decoder, draft, list(contract.aux_boundaries), [1, 2, 3], max_new_tokens=4)
