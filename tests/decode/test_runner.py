"""Both target runners return the contract's states and logits of a plain forward, and keep
exactly the accepted rows of a tree block."""

import pytest
import torch

from eaglewire.model.capture import capture
from eaglewire.decode.runner import HFRunner, LeanRunner, make_runner
from tiny import ARCHITECTURES, tiny_target

LEAN = ["llama", "qwen2", "qwen3", "mistral"]


def tree_block(ids: torch.Tensor, P: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """After ``P`` committed tokens: tokens P..P+3 of ``ids`` as a chain plus a decoy sibling of token P+1 (row 4);
    (block [5], mask [5, P+5])."""
    block = torch.cat([ids[P:P + 4], torch.tensor([7])])
    mask = torch.zeros(5, P + 5, dtype=torch.bool)
    mask[:, :P] = True
    for i in range(4):
        mask[i, P:P + i + 1] = True
    mask[4, [P, P + 4]] = True
    return block, mask


@pytest.mark.parametrize("runner_cls, arch", [(LeanRunner, a) for a in LEAN] + [(HFRunner, a) for a in ARCHITECTURES])
def test_runner_matches_capture_through_a_tree_block(runner_cls, arch):
    target = tiny_target(arch, initializer_range=0.2)
    bounds = [0, 2, 8]
    ids = torch.randint(0, 256, (14,), generator=torch.Generator().manual_seed(0))
    ref = capture(target, ids[None], bounds)
    runner = runner_cls(target, bounds)
    _, aux = runner.forward(ids[:9], torch.arange(9), None)
    runner.commit(list(range(9)))
    block, mask = tree_block(ids)
    _, aux_block = runner.forward(block, torch.tensor([9, 10, 11, 12, 10]), mask)
    runner.commit([0, 1, 2, 3])  # the decoy is dropped
    last, aux_next = runner.forward(ids[13:14], torch.tensor([13]), None)
    tol = dict(rtol=1e-3, atol=2e-4)
    torch.testing.assert_close(aux, ref.aux_hidden[0, :9], **tol)
    torch.testing.assert_close(aux_block[:4], ref.aux_hidden[0, 9:13], **tol)
    torch.testing.assert_close(aux_next, ref.aux_hidden[0, 13:], **tol)
    torch.testing.assert_close(runner.head(last), target.head(ref.last_hidden[0, 13:]), **tol)


def test_lean_cache_grows_past_its_first_size():
    target = tiny_target("llama", initializer_range=0.2)
    runner = LeanRunner(target, [2], max_length=4)
    runner.forward(torch.arange(10), torch.arange(10), None)
    runner.commit(list(range(10)))
    assert runner.length == 10 and runner.k_cache.shape[2] >= 10


def test_make_runner_picks_lean_where_it_can():
    assert isinstance(make_runner(tiny_target("qwen3"), [2]), LeanRunner)
    assert isinstance(make_runner(tiny_target("gemma3"), [2]), HFRunner)
    with pytest.raises(ValueError, match="no lean forward for model type 'gemma3_text'"):
        make_runner(tiny_target("gemma3"), [2], lean=True)


@pytest.mark.parametrize("arch", LEAN)
def test_static_forward_is_the_dynamic_forward(arch):
    """The static forward (whole-cache mask, writes by index: what a CUDA graph replays) computes what the dynamic
    one does, through a prefill, a tree block with a rejected sibling and a step. fp32, the tolerance of the
    capture comparison above: masked keys add exact zeros, but SDPA takes another CPU kernel (and summation
    order) for a masked call over the whole cache than for a causal one over the prefix (6e-5 apart, measured)."""
    target = tiny_target(arch, initializer_range=0.2)
    ids = torch.randint(0, 256, (14,), generator=torch.Generator().manual_seed(0))
    block, mask = tree_block(ids)
    outs = []
    for static in (False, True):
        runner = LeanRunner(target, [0, 2, 8], max_length=32, static=static)
        got = [runner.forward(ids[:9], torch.arange(9), None)]
        runner.commit(list(range(9)))
        got.append(runner.forward(block, torch.tensor([9, 10, 11, 12, 10]), mask))
        runner.commit([0, 1, 2, 3])
        got.append(runner.forward(ids[13:14], torch.tensor([13]), None))
        outs.append([t for pair in got for t in pair])
    for dynamic, static in zip(*outs):
        torch.testing.assert_close(static, dynamic, rtol=1e-3, atol=2e-4)
