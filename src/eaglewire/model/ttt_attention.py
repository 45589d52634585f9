"""Training-time-test attention: step j's query at position t attends causally to step
0's keys and to the keys of steps 1..j at position t only (the diagonal).

Shapes: B batch, nH heads, T tokens, hd head dim, j+1 steps so far.

Two implementations with the same math:
- ``ttt_attention_dense``: the [B, nH, T, T] score matrix in memory, any device;
- ``ttt_attention_flash`` (CPU) and ``ttt_attention_flash_cuda`` (CUDA, bf16/fp16): the causal
  block through PyTorch's flash kernel for that device (blocked, never materialised), merged
  with the diagonal scores through log-sum-exp. The backward calls the kernel's backward with
  the *merged* output and log-sum-exp, which gives the causal block's exact share of the
  gradient (as ring attention does for each key block); the diagonal terms are [B, nH, T]
  vectors, differentiated by hand. On a GPU the dense path's [B, nH, T, T] fp32 scores were
  most of a TTT step's memory traffic.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` the draft's q and k leave RoPE in fp32
(the rotary tables are fp32) while v leaves its projection in bf16: the flash path runs its
math in fp32 on whatever float inputs it gets (the CPU kernel takes one dtype for q, k and v)
and hands each input its gradient in that input's own dtype.
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger(__name__)

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """q [B, nH, T, hd]; keys/values: one [B, nH, T, hd] per step 0..j. Returns [B, nH, T, hd]."""
    if q.device.type == "cpu" and q.dtype == torch.float32:
        return ttt_attention_flash(q, keys, values)
    if q.device.type == "cuda" and _cuda_half_dtype(q) is not None and not _CUDA_FLASH_FAILED:
        try:
            return ttt_attention_flash_cuda(q, keys, values)
        except RuntimeError as err:  # a GPU or build whose flash kernel refuses these inputs
            _cuda_flash_failed(err)
    return ttt_attention_dense(q, keys, values)


_CUDA_FLASH_FAILED = False


def _cuda_flash_failed(err: RuntimeError) -> None:
    global _CUDA_FLASH_FAILED
    _CUDA_FLASH_FAILED = True
    log.warning("TTT attention falls back to the dense path on this GPU: its flash kernel refused (%s)", err)


def _cuda_half_dtype(q: torch.Tensor) -> torch.dtype | None:
    """The half precision CUDA's flash kernel would run in: autocast's, else q's own; None for fp32 math."""
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
    else:
        dtype = q.dtype
    return dtype if dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 \
        else None


def ttt_attention_dense(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1])
    T = q.shape[-2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = [(q @ keys[0].transpose(-1, -2)).masked_fill(~causal, float("-inf"))]  # [B, nH, T, T]
    scores += [(q * k).sum(-1, keepdim=True) for k in keys[1:]]  # j x [B, nH, T, 1]
    probs = torch.softmax(torch.cat(scores, dim=-1).float() * scale, dim=-1).to(q.dtype)  # [B, nH, T, T+j]
    out = probs[..., :T] @ values[0]
    for i, v in enumerate(values[1:]):
        out = out + probs[..., T + i:T + i + 1] * v
    return out


def ttt_attention_flash(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    kv = [t for pair in zip(keys, values) for t in pair]
    return _TTTFlash.apply(1.0 / math.sqrt(q.shape[-1]), q, *kv)


def _merge(out0: torch.Tensor, lse0: torch.Tensor, diag_scores: list[torch.Tensor],
           diag_values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Combine the causal block (normalised out0 [B, nH, T, hd], lse0 [B, nH, T]) with the
    diagonal scores (each [B, nH, T]); returns (out, lse, diagonal probabilities)."""
    lse = torch.logsumexp(torch.stack([lse0, *diag_scores]), dim=0)  # [B, nH, T]
    out = out0 * torch.exp(lse0 - lse)[..., None]
    probs = [torch.exp(s - lse) for s in diag_scores]
    for p, v in zip(probs, diag_values):
        out = out + p[..., None] * v
    return out, lse, probs


class _TTTFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scale: float, q: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        ctx.dtypes = [t.dtype for t in (q, *kv)]
        with torch.autocast("cpu", enabled=False):  # fp32 math whatever autocast is on around it
            return _TTTFlash._forward(ctx, scale, q.float(), *(t.float() for t in kv))

    @staticmethod
    def _forward(ctx, scale: float, q: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        k0, v0 = kv[0], kv[1]
        out0, lse0 = _flash(q, k0, v0, 0.0, True, scale=scale)
        diag_k, diag_v = kv[2::2], kv[3::2]
        scores = [(q * k).sum(-1) * scale for k in diag_k]  # j x [B, nH, T]
        out, lse, probs = _merge(out0, lse0, scores, diag_v)
        ctx.scale = scale
        ctx.save_for_backward(q, out, lse, *kv, *probs)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        with torch.autocast("cpu", enabled=False):
            dq, *grads = _TTTFlash._backward(ctx, grad_out.float())
        return (None, *(g.to(dt) for g, dt in zip((dq, *grads), ctx.dtypes)))

    @staticmethod
    def _backward(ctx, grad_out: torch.Tensor) -> list[torch.Tensor]:
        """Gradients (fp32) of q, then k0, v0, k1, v1, ..."""
        scale = ctx.scale
        q, out, lse, *rest = ctx.saved_tensors
        steps = (len(rest) + 1) // 3  # 2 tensors per step, 1 probability per diagonal step
        kv, probs = rest[:2 * steps], rest[2 * steps:]
        grad_out = grad_out.contiguous()
        dq, dk0, dv0 = _flash_backward(grad_out, q, kv[0], kv[1], out, lse, 0.0, True, scale=scale)
        grads = [dk0, dv0]
        D = (grad_out * out).sum(-1)  # [B, nH, T]
        for p, k, v in zip(probs, kv[2::2], kv[3::2]):
            dS = p * ((grad_out * v).sum(-1) - D)  # [B, nH, T]
            dq = dq + (dS * scale)[..., None] * k
            grads += [(dS * scale)[..., None] * q, p[..., None] * grad_out]
        return [dq, *grads]


def ttt_attention_flash_cuda(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """``ttt_attention_flash`` on CUDA: the kernel runs in the half precision autocast (or q) asks for, the
    merge in fp32; returns [B, nH, T, hd] in q's dtype, as the dense path does (a bf16 draft outside autocast,
    e.g. tune's trace, feeds it to its bf16 o_proj)."""
    kv = [t for pair in zip(keys, values) for t in pair]
    return _TTTFlashCUDA.apply(1.0 / math.sqrt(q.shape[-1]), _cuda_half_dtype(q), q, *kv)


class _TTTFlashCUDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scale: float, half: torch.dtype, q: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        ctx.dtypes = [t.dtype for t in (q, *kv)]
        with torch.autocast("cuda", enabled=False):
            qh, k0, v0 = (t.to(half).contiguous() for t in (q, kv[0], kv[1]))
            out0, lse0, cum_q, cum_k, max_q, max_k, seed, offset, _ = \
                torch.ops.aten._scaled_dot_product_flash_attention(qh, k0, v0, 0.0, True, False, scale=scale)
            qf = q.float()
            diag_k, diag_v = [k.float() for k in kv[2::2]], [v.float() for v in kv[3::2]]
            scores = [(qf * k).sum(-1) * scale for k in diag_k]  # j x [B, nH, T]
            out, lse, probs = _merge(out0.float(), lse0[..., :q.shape[-2]], scores, diag_v)
        ctx.scale, ctx.flash_state = scale, (cum_q, cum_k, max_q, max_k, seed, offset)
        ctx.save_for_backward(qh, k0, v0, out.to(half), lse.contiguous(), qf, *diag_k, *diag_v, *probs)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        scale = ctx.scale
        qh, k0, v0, out_h, lse, qf, *rest = ctx.saved_tensors
        j = len(rest) // 3
        diag_k, diag_v, probs = rest[:j], rest[j:2 * j], rest[2 * j:]
        cum_q, cum_k, max_q, max_k, seed, offset = ctx.flash_state
        with torch.autocast("cuda", enabled=False):
            go = grad_out.float()
            dq, dk0, dv0 = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                go.to(qh.dtype).contiguous(), qh, k0, v0, out_h, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed,
                offset, scale=scale)
            dq = dq.float()
            grads = [dk0.float(), dv0.float()]
            D = (go * out_h.float()).sum(-1)  # [B, nH, T]: the same rounded output the kernel's backward read
            for p, k, v in zip(probs, diag_k, diag_v):
                dS = p * ((go * v).sum(-1) - D)  # [B, nH, T]
                dq = dq + (dS * scale)[..., None] * k
                grads += [(dS * scale)[..., None] * qf, p[..., None] * go]
        return (None, None, *(g.to(dt) for g, dt in zip((dq, *grads), ctx.dtypes)))
