"""The fixed-shape decode step (decode/static_step.py) == the grouped batched path, row by row.

On CPU the step runs eagerly (``mode="static"``): the same ops a CUDA graph records. fp32 tiny
targets (initializer_range=0.2: argmax gaps far above the noise of attending over the whole,
masked, cache width). The ``cuda`` tests check the captured graph against that eager step on a
real GPU.
"""

import logging

import pytest
import torch

from eaglewire.decode.batched import BatchedDecoder
from eaglewire.decode.runner import LEAN_MODEL_TYPES
from eaglewire.decode.sampling import SamplingParams
from eaglewire.decode.static_step import cache_columns, key_mask, split_rows
from fake_cuda import fake_cuda
from tiny import tiny_target

LENGTHS = (5, 12, 1, 300, 30, 9, 7)  # ragged: pads from 0 to 299
NEW = 16

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(seed: int = 1, lengths=LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def _stops(free: list[tuple[list[int], bool]]) -> set[int]:
    """Stop tokens that end rows 0 and 4 early, at different steps (by their 4th / 10th tokens)."""
    return {free[0][0][3], free[4][0][9]}


@pytest.fixture(scope="module", params=LEAN_MODEL_TYPES)
def target(request):
    return tiny_target(request.param, initializer_range=0.2)


def test_static_greedy_equals_grouped_with_ragged_prompts_and_early_stops(target):
    grouped, static = BatchedDecoder(target, mode="grouped"), BatchedDecoder(target, mode="static")
    prompts = _prompts()
    stops = _stops(grouped.generate(prompts, max_new_tokens=NEW, stop_token_ids=set()))
    expected = grouped.generate(prompts, max_new_tokens=NEW, stop_token_ids=stops)
    assert len({len(t) for t, s in expected if s}) >= 2 and not all(s for _, s in expected)  # not vacuous
    assert static.generate(prompts, max_new_tokens=NEW, stop_token_ids=stops) == expected
    assert static.stats.mode == "static" and grouped.stats.mode == "grouped"
    assert static.stats.new_tokens == grouped.stats.new_tokens and static.stats.steps == NEW - 1


def test_a_reused_step_ignores_the_last_calls_cache(target):
    """The same step (one bucket of columns) serves calls of other prompts and widths; its cache still holds
    the last call's keys and values, in columns the new call masks or overwrites."""
    grouped, static = BatchedDecoder(target, mode="grouped"), BatchedDecoder(target, mode="static")
    stops = _stops(grouped.generate(_prompts(), max_new_tokens=NEW, stop_token_ids=set()))
    assert static.generate(_prompts(), max_new_tokens=NEW, stop_token_ids=stops) \
        == grouped.generate(_prompts(), max_new_tokens=NEW, stop_token_ids=stops)
    reused = static._static
    for seed, lengths in ((2, (40, 3, 17, 250, 8, 60, 2)), (3, (260,) * 7)):  # 512 columns, all
        prompts = _prompts(seed, lengths)
        expected = grouped.generate(prompts, max_new_tokens=NEW, stop_token_ids=stops)
        assert static.generate(prompts, max_new_tokens=NEW, stop_token_ids=stops) == expected
    assert static._static is reused


def test_static_all_rows_stopping_at_once_runs_no_step(target):
    grouped, static = BatchedDecoder(target, mode="grouped"), BatchedDecoder(target, mode="static")
    prompts = _prompts(seed=2)
    firsts = {tokens[0] for tokens, _ in grouped.generate(prompts, max_new_tokens=NEW, stop_token_ids=set())}
    assert static.generate(prompts, max_new_tokens=NEW, stop_token_ids=firsts) == [([], True)] * len(prompts)
    assert static.stats.steps == 0
    assert static.generate(prompts, max_new_tokens=1, stop_token_ids=set()) \
        == grouped.generate(prompts, max_new_tokens=1, stop_token_ids=set())


def test_static_sampling_is_reproducible_from_the_seed():
    target = tiny_target("llama", initializer_range=0.2)
    decoder, prompts = BatchedDecoder(target, mode="static"), _prompts()
    hot = SamplingParams(temperature=1.5, top_p=0.95)
    runs = [decoder.generate(prompts, max_new_tokens=NEW, stop_token_ids={0}, sampling=hot, seed=s)
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    top1 = SamplingParams(temperature=1.0, top_k=1)  # sampling from the argmax alone is greedy
    assert decoder.generate(prompts, max_new_tokens=NEW, stop_token_ids={0}, sampling=top1, seed=3) \
        == BatchedDecoder(target, mode="grouped").generate(prompts, max_new_tokens=NEW, stop_token_ids={0})


def test_modes_default_per_device_and_bad_modes_are_clear_errors():
    target = tiny_target("llama", num_layers=1)
    assert BatchedDecoder(target).mode == "grouped"  # CPU: the grouped path stays the default
    with pytest.raises(ValueError, match="mode must be one of auto, grouped, static, graph; got 'fast'"):
        BatchedDecoder(target, mode="fast")
    with pytest.raises(ValueError, match="mode 'graph' captures CUDA graphs; this target is on cpu.*'static'"):
        BatchedDecoder(target, mode="graph")


def test_static_step_keeps_every_tensor_on_the_device():
    """On the CPU's stand-in for CUDA: the static step mixes no host tensor into a device op."""
    target = tiny_target("llama", initializer_range=0.2)
    prompts = _prompts()
    expected = BatchedDecoder(target, mode="grouped").generate(prompts, max_new_tokens=NEW, stop_token_ids={0})
    with fake_cuda():
        target.model.to("cuda")
        try:
            decoder = BatchedDecoder(target, mode="static")
            assert decoder.generate(prompts, max_new_tokens=NEW, stop_token_ids={0}) == expected
        finally:
            target.model.to("cpu")


def test_failed_capture_falls_back_to_the_grouped_path_with_one_warning(caplog):
    """The stand-in for CUDA has no graphs: capture fails, as it would for an op a graph refuses."""
    target = tiny_target("llama", initializer_range=0.2)
    prompts = _prompts()
    expected = BatchedDecoder(target, mode="grouped").generate(prompts, max_new_tokens=NEW, stop_token_ids={0})
    with fake_cuda(), caplog.at_level(logging.WARNING, logger="eaglewire.decode.batched"):
        target.model.to("cuda")
        try:
            decoder = BatchedDecoder(target)
            assert decoder.mode == "graph"
            for _ in range(2):
                assert decoder.generate(prompts, max_new_tokens=NEW, stop_token_ids={0}) == expected
            assert decoder.stats.mode == "grouped" and decoder.mode == "grouped"
        finally:
            target.model.to("cpu")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "CUDA graph capture failed" in warnings[0]


def test_graph_mode_on_the_stand_in_for_cuda_gives_the_eager_tokens():
    """The graph path on the CPU's stand-in with graphs (fake_cuda: a replay re-runs the captured calls into the
    captured buffers, a host read inside a capture raises): captured, replayed across calls, no fallback, the
    tokens of the grouped path (fp32)."""
    target = tiny_target("llama", initializer_range=0.2)
    prompts = _prompts()
    expected = BatchedDecoder(target, mode="grouped").generate(prompts, max_new_tokens=NEW, stop_token_ids={0})
    with fake_cuda(graphs=True):
        target.model.to("cuda")
        try:
            decoder = BatchedDecoder(target)
            for _ in range(2):
                assert decoder.generate(prompts, max_new_tokens=NEW, stop_token_ids={0}) == expected
                assert decoder.stats.mode == "graph"
        finally:
            target.model.to("cpu")


def test_key_mask_sees_each_rows_prompt_and_new_tokens_up_to_the_column():
    mask = key_mask(torch.tensor([0, 2, 3]), torch.tensor([3]), torch.arange(6))
    assert mask.shape == (3, 1, 1, 6)
    assert mask[:, 0, 0].int().tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0]]


def test_cache_columns_round_up_to_the_bucket():
    assert [cache_columns(n, 256) for n in (1, 256, 257)] == [256, 256, 512]


def test_split_rows_cuts_each_row_at_its_first_stop():
    tokens = torch.tensor([[5, 1, 9, 1], [2, 3, 4, 5], [9, 9, 9, 9]])
    assert split_rows(tokens, torch.tensor([1, 9])) == [([5], True), ([2, 3, 4, 5], False), ([], True)]
    assert split_rows(tokens[:, :0], torch.tensor([1])) == [([], False)] * 3
    assert split_rows(tokens, torch.tensor([], dtype=torch.long))[0] == ([5, 1, 9, 1], False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the static step's CPU tests cover its ops")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_graph_equals_the_eager_static_step_on_cuda(dtype, greedy):
    """The graph replays the eager step's kernels on the same buffers: the same tokens, bit for bit in any
    dtype; fp32 also equals the grouped path. A second call (another width, one bucket) replays the same graph."""
    target = tiny_target("llama", initializer_range=0.2)
    target.model.to("cuda", dtype)
    sampling = None if greedy else SamplingParams(temperature=1.0, top_p=0.9)
    graph, eager = BatchedDecoder(target), BatchedDecoder(target, mode="static")
    assert graph.mode == "graph"
    for seed, lengths in ((1, LENGTHS), (2, (40, 3, 17, 250, 8, 60, 2))):
        prompts = _prompts(seed, lengths)
        out = graph.generate(prompts, max_new_tokens=NEW, stop_token_ids={0}, sampling=sampling, seed=seed)
        assert graph.stats.mode == "graph"
        assert out == eager.generate(prompts, max_new_tokens=NEW, stop_token_ids={0}, sampling=sampling, seed=seed)
        if greedy and dtype == torch.float32:
            assert out == BatchedDecoder(target, mode="grouped").generate(prompts, max_new_tokens=NEW,
                                                                          stop_token_ids={0})
    assert graph._static.graph is not None
