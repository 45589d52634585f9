"""Both target runners return the contract's states and logits of a plain forward, and keep
exactly the accepted rows of a tree block."""

import pytest
import torch

from eaglewire.model.boundary_capture import capture
from eaglewire.decode.runner import HFRunner, LeanRunner, make_runner
from tiny import ARCHITECTURES, tiny_target

LEAN = ["llama", "qwen2", "qwen3", "mistral"]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])]


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups, rows", [(1, 1), (3, 1), (3, 5)])
def test_attention_bias_attends_as_the_bool_mask_to_the_bit(dtype, groups, rows, device):
    """SDPA turns a bool mask into this very bias before its kernel, so the outputs are equal, not close."""
    from eaglewire.decode.attention import attend, attend_biased, attention_bias

    g = torch.Generator().manual_seed(groups * 10 + rows)
    q = torch.randn(2 * groups, rows, 16, generator=g).to(device, dtype)  # [nH, n, hd]
    k, v = (torch.randn(2, 37, 16, generator=g).to(device, dtype) for _ in range(2))  # [nKV, m, hd]
    mask = (torch.rand(1, rows, 37, generator=g) > 0.4).to(device)  # [1, n, m]
    mask[..., 0] = True  # every row sees a key
    bias = attention_bias(mask, groups, dtype)
    assert bias.shape == (1, groups * rows, 37) and bias.dtype == dtype
    assert torch.equal(attend_biased(q, k, v, bias, 0.25), attend(q, k, v, mask, 0.25))
    reference = torch.nn.functional.scaled_dot_product_attention(  # K/V repeated per query head, the bool mask
        q, k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(attend(q, k, v, mask, 0.25), reference, rtol=2e-2 if dtype != torch.float32 else 1e-5,
                               atol=1e-2 if dtype != torch.float32 else 1e-6)  # another kernel: its rounding


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_with_a_signed_sin_is_rotate_half_to_the_bit(dtype, device):
    """The lean forward's RoPE (a roll and the sin's sign folded in once a forward) equals HF's rotate-half."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from eaglewire.decode.runner import _rotate, rope

    target = tiny_target("llama")
    target.model.to(device)
    positions = torch.tensor([0, 3, 7, 200], device=device)
    x = torch.randn(4, 6, target.text_config.head_dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    cos, signed_sin = rope(target.decoder.rotary_emb, x[:, 0], positions)  # [N, 1, hd]
    hf_cos, hf_sin = target.decoder.rotary_emb(x[None, :, 0], positions[None])  # [1, N, hd]
    hf, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], hf_cos, hf_sin)  # [1, n, N, hd]
    assert torch.equal(_rotate(x, cos, signed_sin), hf[0].transpose(0, 1))


def test_a_static_step_prepares_its_mask_once_not_once_a_layer():
    """What a layer adds to a captured step is its own work: the mask's bias (SDPA's bool -> 0/-inf, tiled for the
    query groups) is made once per forward, so on CUDA a step of L layers launches ~4L fewer small kernels."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    def ops(num_layers: int) -> Counter:
        runner = LeanRunner(tiny_target("llama", num_layers=num_layers), [1], max_length=16, static=True)
        runner.forward(torch.arange(3), torch.arange(3), None)
        runner.commit([0, 1, 2])
        with Ops() as mode:
            runner.forward(torch.tensor([5]), torch.tensor([3]), None)
        return mode.seen

    per_two_layers = ops(4) - ops(2)
    assert sum(per_two_layers[op] for op in ("_linear_pointwise", "mm", "addmm", "bmm")) >= 8  # it counts
    assert not {"where", "scalar_tensor", "masked_fill_", "bitwise_not", "logical_not"} & set(per_two_layers), \
        per_two_layers
    assert per_two_layers["cat"] == 0 and per_two_layers["neg"] == 0, per_two_layers  # no mask tiling, no rotate cat
