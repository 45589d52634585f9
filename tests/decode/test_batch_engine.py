"""Continuous batching: every sequence of a batch decodes as it would alone, whoever joins or leaves.

fp32 on the tiny targets: a row of a batched GEMM can round otherwise than the same row alone (the kernel's
blocking follows the number of rows), ~1e-7 relative; that flips a greedy token only where the target's top two
logits tie that closely. So each output equals its output alone, or differs first right after such a near-tie, and
the test says which it saw.
"""

import functools

import pytest
import torch

from eaglewire.decode.batch_engine import BatchEngine
from eaglewire.decode.runner import LeanRunner, LeanWeights, forward_blocks
from eaglewire.decode.sampling import SamplingParams
from eaglewire.concurrency.schedule import Schedule, ScheduleKey, ScheduleRange
from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
from tiny import random_dflash_draft, tiny_target
from test_spec_decoder import random_draft

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 6  # a random draft is right often enough over a tiny vocabulary to exercise acceptance
NEAR_TIE = 1e-4  # top-two logit gap (relative to the top) under which a row's rounding may pick either


@functools.lru_cache(maxsize=None)
def target_of(arch="llama"):
    return tiny_target(arch, initializer_range=0.2, vocab_size=VOCAB)


def prompt_of(seed, length):
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def decoders(kind):
    """A SpecDecoder of each kind on the tiny target: plain, EAGLE-3 (chain and tree), DFlash."""
    target = target_of()
    if kind == "plain":
        return SpecDecoder(target)
    if kind == "dflash":
        draft, contract = random_dflash_draft(target, block_size=4)
        return SpecDecoder(target, draft, contract, SpecConfig.chain(3))
    draft, contract = random_draft(target)
    spec = SpecConfig.chain(3) if kind == "eagle3 chain" else SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
    return SpecDecoder(target, draft, contract, spec)


def near_tie_at(target, prompt, tokens, i):
    """Whether the target's top two logits after prompt + tokens[:i] are within NEAR_TIE of each other."""
    ids = torch.tensor(prompt + tokens[:i])[None]
    logits = target.model(ids).logits[0, -1].float()
    top = logits.topk(2).values
    return bool(top[0] - top[1] <= NEAR_TIE * top[0].abs().clamp(min=1))


def assert_as_alone(target, prompt, got, alone):
    """``got`` equals ``alone``, or their first difference follows a near-tie of the target's top two logits."""
    if got == alone:
        return "equal"
    i = next(i for i, (a, b) in enumerate(zip(got, alone)) if a != b)
    assert near_tie_at(target, prompt, alone, i), f"differs at token {i} without a near-tie: {got} vs {alone}"
    return f"differs after a near-tie at token {i}"


def drive(engine, requests, joins):
    """Run ``requests`` (prompt, max tokens) through ``engine``: those of ``joins[step]`` join before that step.
    -> each request's output."""
    outputs, seqs, step = {}, {}, 0
    pending = dict(joins)
    while pending or engine.live:
        for r in pending.pop(step, []):
            prompt, n = requests[r]
            seqs[r] = engine.add(prompt, max_new_tokens=n)
        engine.step()
        step += 1
    for r, seq in seqs.items():
        outputs[r] = seq.produced
    return outputs


@pytest.mark.parametrize("kind", ["plain", "eagle3 chain", "eagle3 tree", "dflash"])
def test_eight_mixed_requests_joining_mid_flight_decode_as_alone(kind):
    decoder = decoders(kind)
    target = decoder.target
    requests = [(prompt_of(r, 3 + 2 * r), 6 + 3 * (r % 4)) for r in range(8)]  # mixed prompt and reply lengths
    joins = {0: [0, 1, 2], 1: [3], 3: [4, 5], 6: [6, 7]}  # some join while others are mid-way
    alone = [SpecDecoder(target).generate(p, max_new_tokens=n)[0] for p, n in requests]
    got = drive(BatchEngine(decoder), requests, joins)
    verdicts = [assert_as_alone(target, requests[r][0], got[r], alone[r]) for r in range(8)]
    assert verdicts.count("equal") >= 6, verdicts  # a near-tie now and then, not a rule


def test_speculation_accepts_in_a_batch():
    """The batched rounds do verify drafts (not only roots): accept lengths above 1 at batch size > 1."""
    decoder = decoders("eagle3 chain")
    engine = BatchEngine(decoder)
    seqs = [engine.add(prompt_of(r, 5), max_new_tokens=24) for r in range(4)]
    while engine.live:
        engine.step()
    assert max(max(s.stats.accept_lengths) for s in seqs) > 1
    assert all(max(s.stats.verified_lengths) == 4 for s in seqs)


def test_a_cancelled_request_frees_its_rows_and_the_others_finish_unchanged():
    decoder = decoders("eagle3 tree")
    engine = BatchEngine(decoder)
    requests = [(prompt_of(r, 4 + r), 16) for r in range(4)]
    seqs = [engine.add(p, max_new_tokens=n) for p, n in requests]
    engine.step(), engine.step()
    engine.remove(seqs[1])  # its client left mid-batch
    assert seqs[1] not in engine.live and len(engine._free) == 1
    newcomer = engine.add(prompt_of(9, 5), max_new_tokens=8)  # takes the freed slot (its cache, its drafter)
    assert newcomer.slot is seqs[1].slot
    while engine.live:
        engine.step()
    for r in (0, 2, 3):
        alone = SpecDecoder(decoder.target).generate(requests[r][0], max_new_tokens=16)[0]
        assert_as_alone(decoder.target, requests[r][0], seqs[r].produced, alone)
    alone = SpecDecoder(decoder.target).generate(prompt_of(9, 5), max_new_tokens=8)[0]
    assert_as_alone(decoder.target, prompt_of(9, 5), newcomer.produced, alone)


def test_the_schedule_switches_between_plain_and_speculation_by_batch_size():
    """Speculate at 1-2 live sequences, plain above: outputs unchanged, each step's kind as scheduled, and a
    sequence that decoded plainly drafts again once the batch shrinks (its draft caught up on what it missed)."""
    decoder = decoders("eagle3 chain")
    schedule = Schedule([ScheduleRange(2, SpecConfig.chain(3)), ScheduleRange(3, None)])
    engine = BatchEngine(decoder, schedule)
    requests = [(prompt_of(r, 4), 6 if r else 30) for r in range(4)]
    seqs = [engine.add(p, max_new_tokens=n) for p, n in requests]
    kinds = []
    while engine.live:
        batch = len(engine.live)
        engine.step()
        kinds.append((batch, engine.last_shape))
    assert all((shape is None) == (batch > 2) for batch, shape in kinds)
    assert {shape is None for _, shape in kinds} == {True, False}
    long = seqs[0].stats.verified_lengths
    assert long[0] == 1 and long[-1] == 4  # plain while the batch was full, drafting at the end
    for seq, (prompt, n) in zip(seqs, requests):
        assert_as_alone(decoder.target, prompt, seq.produced, SpecDecoder(decoder.target).generate(prompt, max_new_tokens=n)[0])


def test_sampled_requests_in_a_batch_repeat_with_their_seed():
    decoder = decoders("eagle3 tree")
    sampling = SamplingParams(temperature=1.0, seed=7)
    outs = []
    for others in (0, 3):  # alone, then beside three greedy requests
        engine = BatchEngine(decoder)
        seq = engine.add(prompt_of(1, 5), max_new_tokens=12, sampling=sampling)
        for r in range(others):
            engine.add(prompt_of(r + 2, 4), max_new_tokens=12)
        while engine.live:
            engine.step()
        outs.append(seq.produced)
    assert outs[0] == outs[1]


def test_packed_forward_equals_each_sequence_alone():
    """forward_blocks over three runners = each runner's own forward (fp32: to rounding)."""
    target = target_of()
    weights = LeanWeights(target)
    alone = [LeanRunner(target, [2, 4, 8], weights=weights) for _ in range(3)]
    packed = [LeanRunner(target, [2, 4, 8], weights=weights) for _ in range(3)]
    prompts = [prompt_of(r, 3 + 2 * r) for r in range(3)]
    for a, p, prompt in zip(alone, packed, prompts):
        for runner in (a, p):
            runner.forward(torch.tensor(prompt), torch.arange(len(prompt)), None)
            runner.commit(list(range(len(prompt))))
    blocks = [(torch.tensor([1]), torch.tensor([len(prompts[0])]), None),
              (torch.tensor([2, 3, 4]), torch.tensor([5, 6, 6]),
               torch.cat([torch.ones(3, 5, dtype=torch.bool), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]]).bool()], 1)),
              (torch.tensor([5, 0]), torch.tensor([7, 8]), None)]
    got = forward_blocks(packed, blocks)
    for runner, block, (last, aux) in zip(alone, blocks, got):
        want_last, want_aux = runner.forward(*block)
        torch.testing.assert_close(last, want_last, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(aux, want_aux, rtol=1e-5, atol=1e-6)
    for a, p in zip(alone, packed):
        assert a.length == p.length


def test_schedule_choice_key_and_file(tmp_path):
    chain = SpecConfig.chain(3)
    key = ScheduleKey(target="t1", draft="d1", engine="eaglewire 0.1", dtype="bf16", device="AMD EPYC", threads=2)
    schedule = Schedule([ScheduleRange(2, chain), ScheduleRange(4, SpecConfig.chain(1)), ScheduleRange(16, None)],
                        key)
    assert [schedule.shape_for(b) for b in (1, 2, 3, 4, 5, 64)] == [chain, chain, SpecConfig.chain(1),
                                                                   SpecConfig.chain(1), None, None]
    assert schedule.crossover == 4
    assert schedule.describe() == ("chain 3 up to 2, chain 1 up to 4, plain from 5 concurrent requests")
    schedule.save(tmp_path / "s.json")
    loaded = Schedule.load(tmp_path / "s.json")
    assert loaded == schedule
    loaded.check_key(key)
    with pytest.raises(ValueError, match=r"threads: 2 != 4.*tune --concurrency"):
        loaded.check_key(ScheduleKey(**{**key.__dict__, "threads": 4}))
    (tmp_path / "bad.json").write_text('{"ranges": [')
    with pytest.raises(ValueError, match="not a schedule tune wrote"):
        Schedule.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="ascending"):
        Schedule([ScheduleRange(4, None), ScheduleRange(2, chain)])


@pytest.mark.parametrize("min_prob", [0.0, 0.3])
def test_chains_drafted_together_are_each_drafters_own(min_prob):
    """draft_chains over four sequences proposes, round after round, the chain each drafter proposes alone. The
    scores go through GEMMs of other row counts, so they are compared to a tolerance; the tokens exactly: a GEMM's
    row-count rounding (~1e-7 relative in fp32) could only flip an argmax between logits that close, which a six-way
    choice of a random draft practically never holds (the root level's top-two margin is asserted each round)."""
    from eaglewire.decode.eagle3_batch import can_batch, draft_chains

    target = target_of()
    draft, contract = random_draft(target)
    spec = SpecConfig.chain(3, min_prob=min_prob)
    decoder = SpecDecoder(target, draft, contract, spec)
    engine = BatchEngine(decoder)
    seqs = [engine.add(prompt_of(r, 4 + r), max_new_tokens=20) for r in range(4)]
    compared = 0
    while len(engine.live) == 4:
        for seq in seqs:
            engine._catch_up(seq, spec)
        drafters = [seq.slot.drafter for seq in seqs]
        assert can_batch(drafters)
        alone = [d.propose(s.root, s.length) for s, d in zip(seqs, drafters)]
        together = draft_chains(drafters, [s.root for s in seqs], [s.length for s in seqs], 3, spec.min_score)
        for d in drafters:  # the root's top two are far apart, so no rounding can swap them
            top2 = torch.log_softmax(d.draft.logits(d.root_out[0]).float(), -1).topk(2).values[0]
            assert top2[0] - top2[1] > 1e-4
        for a, t in zip(alone, together):
            assert t.tokens.tolist() == a.tokens.tolist() and t.parents.tolist() == a.parents.tolist()
            torch.testing.assert_close(t.scores, a.scores, rtol=1e-5, atol=1e-5)
            compared += 1
        engine.step()  # a round as the engine runs it (draft_chains again, then verify)
    assert compared >= 8


def test_contexts_extended_together_are_each_drafters_own():
    """extend_together over three drafters enters the same keys, values and last outputs as each drafter's extend."""
    from eaglewire.decode.eagle3_batch import extend_together

    target = target_of()
    draft, contract = random_draft(target)
    decoder = SpecDecoder(target, draft, contract, SpecConfig.chain(3))
    alone, together = [decoder.drafter.fork() for _ in range(3)], [decoder.drafter.fork() for _ in range(3)]
    H = target.text_config.hidden_size
    gen = torch.Generator().manual_seed(0)
    for b in range(3):
        prompt_aux, prompt_next = torch.randn(4 + b, 3 * H, generator=gen), prompt_of(b, 4 + b)
        for d in (alone[b], together[b]):
            d.start(prompt_aux, prompt_next, 64)
    entries = [(torch.randn(n, 3 * H, generator=gen), prompt_of(10 + b, n), 4 + b) for b, n in enumerate((1, 3, 2))]
    for d, entry in zip(alone, entries):
        d.extend(*entry)
    extend_together(together, entries)
    for a, t in zip(alone, together):
        assert t.cache.committed == a.cache.committed == t.cache.length
        torch.testing.assert_close(t.cache.k, a.cache.k, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(t.cache.v, a.cache.v, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(t.root_out, a.root_out, rtol=1e-5, atol=1e-6)
