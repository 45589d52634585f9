import pytest
import torch

from eaglewire.model.draft import DraftConfig, Eagle3Draft
from eaglewire.model.ttt_attention import ttt_attention_dense, ttt_attention_flash
from tiny import ARCHITECTURES, tiny_config


def make_draft(num_aux=3, vocab=64, draft_vocab=32, seed=0):
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=32, target_hidden_size=48, num_aux=num_aux, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=vocab,
                      draft_vocab_size=draft_vocab)
    draft = Eagle3Draft(cfg).eval()
    for p in draft.parameters():  # norms start at 1: perturb so the test sees them
        p.data.add_(torch.randn_like(p) * 0.1)
    return draft


def reference_attention(q, keys, values):
    """The TTT mask written out in full: causal over step 0, diagonal over later steps."""
    T = q.shape[-2]
    k = torch.cat(keys, dim=2)
    v = torch.cat(values, dim=2)
    mask = [torch.ones(T, T, dtype=torch.bool, device=q.device).tril()] \
        + [torch.eye(T, dtype=torch.bool, device=q.device)] * (len(keys) - 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=torch.cat(mask, dim=1))


def _qkv(steps, T=7, requires_grad=False):
    g = torch.Generator().manual_seed(steps)
    make = lambda: torch.randn(2, 3, T, 8, generator=g).requires_grad_(requires_grad)  # noqa: E731
    return make(), [make() for _ in range(steps)], [make() for _ in range(steps)]


@pytest.mark.parametrize("attention", [ttt_attention_dense, ttt_attention_flash])
@pytest.mark.parametrize("steps", [1, 2, 4])
def test_ttt_attention_matches_full_mask(attention, steps):
    q, keys, values = _qkv(steps)
    torch.testing.assert_close(attention(q, keys, values), reference_attention(q, keys, values))


@pytest.mark.parametrize("steps", [1, 3])
def test_flash_ttt_attention_gradients_match_full_mask(steps):
    """The hand-written backward (flash kernel + diagonal terms) against autograd."""
    q, keys, values = _qkv(steps, T=37, requires_grad=True)
    inputs = [q, *keys, *values]
    grad_out = torch.randn(2, 3, 37, 8, generator=torch.Generator().manual_seed(9))
    want = torch.autograd.grad(reference_attention(q, keys, values), inputs, grad_out)
    got = torch.autograd.grad(ttt_attention_flash(q, keys, values), inputs, grad_out)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_names_follow_sglang_layout():
    names = set(make_draft().state_dict())
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
            "midlayer.mlp.gate_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert not any("embed" in n for n in names)  # embeddings are the target's
    assert make_draft().midlayer.self_attn.q_proj.weight.shape == (32, 64)  # 2H wide input


def test_fc_width_follows_num_aux():
    assert make_draft(num_aux=4).fc.weight.shape == (32, 4 * 48)


@torch.no_grad()
def test_training_unroll_equals_sequential_decoding():
    """Step j at position t in training sees exactly what decoding sees at position t + j."""
    draft = make_draft()
    B, T, H, K = 1, 9, 32, 3
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(B, T + K, H, generator=g)  # embeddings of tokens 1.. (shifted per step)
    fused = draft.fuse(torch.randn(B, T, 3 * 48, generator=g))
    pos = torch.arange(T)[None]
    # Training: step j reads embeddings shifted by j and positions + j.
    cache, hidden, ttt_out = [], fused, []
    for j in range(K):
        hidden = draft.forward_ttt(emb[:, j:j + T], hidden, pos + j, cache)
        ttt_out.append(hidden)
    # Decoding: prefill positions 0..t from target states, then draft K-1 steps one at a time.
    t = 5
    out, k, v = draft.forward_cached(emb[:, :t + 1], fused[:, :t + 1], pos[:, :t + 1], None, None, None)
    torch.testing.assert_close(out[:, t], ttt_out[0][:, t], rtol=1e-5, atol=1e-5)
    hidden = out[:, t:t + 1]
    for j in range(1, K):
        hidden, k_new, v_new = draft.forward_cached(emb[:, t + j:t + j + 1], hidden, torch.tensor([[t + j]]),
                                                    k, v, None)
        k, v = torch.cat([k, k_new], 2), torch.cat([v, v_new], 2)
        torch.testing.assert_close(hidden[:, 0], ttt_out[j][:, t], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_config_from_every_target_architecture(arch):
    cfg = DraftConfig.from_target(tiny_config(arch), num_aux=3, draft_vocab_size=100, vocab_size=256)
    draft = Eagle3Draft(cfg)
    B, T = 2, 5
    emb = torch.randn(B, T, cfg.hidden_size)
    hidden = draft.fuse(torch.randn(B, T, 3 * cfg.target_hidden_size))
    out = draft.forward_ttt(emb, hidden, torch.arange(T).expand(B, T), [])
    assert draft.logits(out).shape == (B, T, 100)


def test_rope_scaling_types_are_honoured():
    base = dict(hidden_size=32, target_hidden_size=32, num_aux=3, num_attention_heads=4, num_key_value_heads=4,
                head_dim=8, intermediate_size=64, vocab_size=64, draft_vocab_size=64, rope_theta=500000.0)
    plain = Eagle3Draft(DraftConfig(**base))
    llama3 = Eagle3Draft(DraftConfig(**base, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}))
    assert not torch.allclose(plain.rotary.inv_freq, llama3.rotary.inv_freq)


def test_bad_config():
    with pytest.raises(ValueError, match="draft_vocab_size 300 must be in"):
        DraftConfig(hidden_size=8, target_hidden_size=8, num_aux=3, num_attention_heads=2, num_key_value_heads=2,
                    head_dim=4, intermediate_size=8, vocab_size=256, draft_vocab_size=300)


def _autocast_unroll(draft, attention, monkeypatch, steps=3):
    """The draft's TTT steps under CPU bf16 autocast with ``attention`` as its TTT attention:
    (last step's pre-norm output, gradients of every weight)."""
    import eaglewire.model.draft as draft_module

    monkeypatch.setattr(draft_module, "ttt_attention", attention)
    g = torch.Generator().manual_seed(3)
    B, T = 2, 23
    emb, aux = torch.randn(B, T + steps, 32, generator=g), torch.randn(B, T, 3 * 48, generator=g)
    draft.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cache, hidden = [], draft.fuse(aux)
        for j in range(steps):
            hidden = draft.forward_ttt(emb[:, j:j + T], hidden, torch.arange(T)[None] + j, cache)
        loss = draft.logits(hidden).float().logsumexp(-1).mean()
    loss.backward()
    return hidden.float(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def test_flash_ttt_attention_agrees_with_dense_under_bf16_autocast(monkeypatch):
    """Under CPU bf16 autocast q/k leave RoPE in fp32 and v its projection in bf16: the flash
    kernel used to refuse the mix ("expected scalar type Float but found BFloat16")."""
    draft = make_draft().train()
    dense_out, dense_grads = _autocast_unroll(draft, ttt_attention_dense, monkeypatch)
    flash_out, flash_grads = _autocast_unroll(draft, ttt_attention_flash, monkeypatch)
    # The dense path's score and value matmuls run in bf16 (8-bit mantissa, ~0.4% per rounding),
    # the flash path's in fp32: the two differ by bf16 rounding, not by a wrong mask or gradient
    # (a wrong one differs by O(1), relative to values of O(1)).
    torch.testing.assert_close(flash_out, dense_out, atol=3e-2, rtol=3e-2)
    assert flash_grads.keys() == dense_grads.keys()
    for name, want in dense_grads.items():
        scale = want.abs().max()
        torch.testing.assert_close(flash_grads[name] / scale, want / scale, atol=3e-2, rtol=0, msg=name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("steps", [1, 3])
def test_cuda_flash_ttt_attention_matches_full_mask(steps):
    """CUDA's flash path (bf16 kernel, fp32 merge, hand-written backward) against the full mask in fp32: bf16
    inputs round to 8 bits, so outputs and gradients agree to bf16's resolution, not fp32's."""
    from eaglewire.model.ttt_attention import ttt_attention_flash_cuda

    g = torch.Generator().manual_seed(steps)
    make = lambda: torch.randn(2, 4, 129, 64, generator=g).cuda().requires_grad_(True)  # noqa: E731
    q, keys, values = make(), [make() for _ in range(steps)], [make() for _ in range(steps)]
    inputs = [q, *[t for pair in zip(keys, values) for t in pair]]
    grad_out = torch.randn(2, 4, 129, 64, generator=g).cuda()
    rounded = [t.detach().bfloat16().float().requires_grad_(True) for t in inputs]  # what the kernel sees
    want_out = reference_attention(rounded[0], rounded[1::2], rounded[2::2])
    want = torch.autograd.grad(want_out, rounded, grad_out)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got_out = ttt_attention_flash_cuda(q, keys, values)
    got = torch.autograd.grad(got_out, inputs, grad_out)
    torch.testing.assert_close(got_out, want_out, atol=2e-2, rtol=2e-2)
    for w, g_ in zip(want, got):
        torch.testing.assert_close(g_, w, atol=5e-2, rtol=5e-2)
    half = [t.detach().bfloat16() for t in inputs]  # a bf16 draft outside autocast (tune's trace): bf16 out
    assert ttt_attention_flash_cuda(half[0], half[1::2], half[2::2]).dtype == torch.bfloat16


@pytest.mark.parametrize("device", ["fake", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the fake one checks the choice")])])
def test_the_draft_norm_is_torchs_fused_kernel_on_cuda(device):
    """On CUDA the norm is one fused kernel in the input's dtype, decoding (weights in the input's dtype) and
    training (fp32 weights, a bf16 input under autocast) alike: values and gradients within a bf16 ulp of the
    fp32-normalised ops the CPU keeps (which round twice)."""
    from contextlib import nullcontext

    from torch.overrides import TorchFunctionMode

    from eaglewire.model.draft import RMSNorm
    from fake_cuda import fake_cuda

    on_device = fake_cuda if device == "fake" else nullcontext

    class Called(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.fused = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.fused += func in (torch.nn.functional.rms_norm, torch.rms_norm)
            return func(*args, **(kwargs or {}))

    def run(where, weight_dtype, x_dtype):
        """(output, d out / d x, d out / d weight) of a norm with random weights, all as fp32 on the host."""
        norm = RMSNorm(64, 1e-5)
        with torch.no_grad():
            norm.weight.uniform_(-1, 3, generator=torch.Generator().manual_seed(0))
        norm.to(where, weight_dtype)
        x = (torch.randn(3, 64, generator=torch.Generator().manual_seed(1)) * 4).to(where, x_dtype).requires_grad_()
        grad = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(where)
        out = norm(x)
        (out.float() * grad).sum().backward()
        return [t.detach().float().cpu() for t in (out, x.grad, norm.weight.grad)]

    for weights, inputs in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                            (torch.float32, torch.float32)):
        want = run("cpu", weights, inputs)
        with on_device(), Called() as calls:
            got = run("cuda", weights, inputs)
        assert calls.fused == 1, (weights, inputs)
        for a, b, what in zip(got, want, ("output", "x.grad", "weight.grad")):
            # a bf16 ulp a value (2^-7 relative at worst); the weight's gradient sums 3 rows of such values
            torch.testing.assert_close(a, b, rtol=2 ** -6, atol=2 ** -6 * b.abs().max().item(),
                                       msg=lambda m: f"{weights} weights, {inputs} input, {what}: {m}")
    with Called() as calls:  # the CPU: the ops
        run("cpu", torch.bfloat16, torch.bfloat16)
    assert calls.fused == 0
