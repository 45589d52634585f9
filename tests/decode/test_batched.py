"""Batched plain decoding == single-sequence plain decoding, row by row, on every lean architecture.

The tiny targets use initializer_range=0.2: their argmax gaps are far above the fp32 noise of
batching (another GEMM shape, packed prefill), so greedy rows cannot flip on a near-tie.
"""

import pytest
import torch

from eaglewire.data.regenerate import split_reply
from eaglewire.decode.batched import BatchedDecoder, attention_groups, generate_batch, prefill_chunks
from eaglewire.decode.spec_decoder import SpecDecoder
from eaglewire.decode.runner import LEAN_MODEL_TYPES
from eaglewire.decode.sampling import SamplingParams
from tiny import tiny_target

LENGTHS = (5, 12, 1, 300, 30, 9, 7)  # decode attention in 2 groups: the 300-token row alone
NEW = 16

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]


def _plain(target, prompts, stops) -> list[tuple[list[int], bool]]:
    """The reference: plain decoding of one sequence at a time, cut like regenerate cuts."""
    return [split_reply(SpecDecoder(target).generate(p, max_new_tokens=NEW, stop_token_ids=stops)[0], stops)
            for p in prompts]


@pytest.fixture(scope="module", params=LEAN_MODEL_TYPES)
def target(request):
    return tiny_target(request.param, initializer_range=0.2)


def _stops_at_different_steps(target, prompts) -> set[int]:
    """Stop tokens that end some rows early, at different steps, and leave one row running."""
    free = _plain(target, prompts, set())
    stops: set[int] = set()
    for row, at in ((0, 3), (4, 9)):  # row 0 stops by its 4th token, row 4 by its 10th
        stops.add(free[row][0][at])
    return stops


@pytest.mark.parametrize("prefill_tokens", [2048, 7])  # 7: prompts split across prefill chunks
def test_greedy_batch_equals_plain_decoding_row_by_row(target, prefill_tokens):
    prompts = _prompts()
    stops = _stops_at_different_steps(target, prompts)
    expected = _plain(target, prompts, stops)
    decoder = BatchedDecoder(target, prefill_tokens=prefill_tokens)
    assert decoder.generate(prompts, max_new_tokens=NEW, stop_token_ids=stops) == expected
    stopped_lengths = {len(tokens) for tokens, stopped in expected if stopped}
    assert len(stopped_lengths) >= 2 and not all(s for _, s in expected)  # not vacuous
    assert decoder.stats.compactions >= 1 and decoder.stats.steps == NEW - 1
    assert decoder.stats.new_tokens == sum(len(t) + s for t, s in expected)


def test_fresh_cache_memory_never_leaks_into_replies(monkeypatch):
    """The cache is allocated uninitialised and only its padding zeroed: were any column read
    before it is written, NaN memory would spread into the logits and change the replies."""
    target = tiny_target("llama", initializer_range=0.2)
    prompts = _prompts()
    expected = _plain(target, prompts, set())
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).fill_(float("nan")))
    assert BatchedDecoder(target).generate(prompts, max_new_tokens=NEW, stop_token_ids=[]) == expected


def test_every_row_stopping_ends_early_and_one_token_replies(target):
    prompts = _prompts(seed=2)
    firsts = {tokens[0] for tokens, _ in _plain(target, prompts, set())}
    decoder = BatchedDecoder(target)
    out = decoder.generate(prompts, max_new_tokens=NEW, stop_token_ids=firsts)
    assert out == [([], True)] * len(prompts) and decoder.stats.steps == 0
    one = decoder.generate(prompts, max_new_tokens=1, stop_token_ids=set())
    assert one == [(tokens[:1], False) for tokens, _ in _plain(target, prompts, set())]


def test_sampling_is_reproducible_from_the_seed():
    target = tiny_target("llama", initializer_range=0.2)
    decoder, prompts = BatchedDecoder(target), _prompts()
    hot = SamplingParams(temperature=1.5, top_p=0.95)
    runs = [decoder.generate(prompts, max_new_tokens=NEW, stop_token_ids={0}, sampling=hot, seed=s)
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert runs[0] != decoder.generate(prompts, max_new_tokens=NEW, stop_token_ids={0})  # not greedy
    top1 = SamplingParams(temperature=1.0, top_k=1)  # sampling from the argmax alone is greedy
    assert decoder.generate(prompts, max_new_tokens=NEW, stop_token_ids={0}, sampling=top1, seed=3) \
        == generate_batch(target, prompts, max_new_tokens=NEW, stop_token_ids={0})


def test_model_without_lean_forward_is_a_clear_error():
    with pytest.raises(ValueError, match="no lean forward for model type 'gemma3_text'.*HF generate"):
        BatchedDecoder(tiny_target("gemma3"))


@pytest.mark.parametrize("prompts, new, message", [
    ([], 4, "no prompts"),
    ([[1, 2], []], 4, "a prompt is empty"),
    ([[1, 2]], 0, "max_new_tokens must be an integer >= 1, got 0"),
])
def test_bad_requests_are_rejected(prompts, new, message):
    decoder = BatchedDecoder(tiny_target("llama", num_layers=1))
    with pytest.raises(ValueError, match=message):
        decoder.generate(prompts, max_new_tokens=new, stop_token_ids=set())


def test_prefill_chunks_pack_prompts_in_order_within_the_budget():
    assert prefill_chunks([3, 5, 1], 4) == [[(0, 0, 3), (1, 0, 1)], [(1, 1, 5)], [(2, 0, 1)]]
    assert prefill_chunks([2, 2], 4) == [[(0, 0, 2), (1, 0, 2)]]
    chunks = prefill_chunks([7, 1, 10, 3], 4)
    assert all(sum(e - s for _, s, e in c) <= 4 for c in chunks)
    assert [p for c in chunks for p in c][:3] == [(0, 0, 4), (0, 4, 7), (1, 0, 1)]


def test_attention_groups_split_rows_where_padding_reads_would_cost_more_than_a_call():
    pads = [300 - n for n in sorted(LENGTHS, reverse=True)]  # [0, 270, 288, 291, 293, 295, 299]
    assert attention_groups(pads) == [(0, 1), (1, 7)]
    assert attention_groups([0, 140, 230, 248, 251, 255, 259]) == [(0, 2), (2, 7)]
    assert attention_groups([3, 3, 3]) == [(0, 3)]
    assert attention_groups([0, 1, 2], split_cost=0) == [(0, 1), (1, 2), (2, 3)]
    assert attention_groups([0, 1, 2], split_cost=10) == [(0, 3)]
