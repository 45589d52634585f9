"""Linear layers for the few-row GEMMs of decoding: one weight, packed once, many calls.

Shapes: N rows (1 for a decode step, 2-32 for a verify pass, B for a batched step), K input
features, M output features.

On CPU the weight goes into oneDNN's blocked layout once (``mkldnn._reorder_linear_weight``)
and every call runs oneDNN's GEMM on it. MKL's fp32 GEMM, which ``x @ w`` reaches, is built for
large matrices: for 4-16 rows it costs 2.5-3x a single row, while the packed oneDNN GEMM costs
1.3x at 8 rows and the same as MKL at 1 row (benchmarks/experiments/engine/gemm_rows.py). Where oneDNN is missing
(other CPU builds) the weight is stored transposed and ``x @ w`` does the work, which beats ``F.linear``
for few rows on CPU. On CUDA the weight stays as it is and ``F.linear`` runs cuBLAS's usual kernel for it,
the one every GPU engine's decode step runs.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

ROWS_HINT = 8  # oneDNN picks its blocking for this many rows; 8 is as fast as 1 at N=1 and best to N=64
MIN_EXACT_ROWS = 2  # row-exact calls run at least this many rows (see PackedLinear.exact_rows)
MAX_EXACT_ROWS = 64  # a call of at most this many rows is a verify (row-exact); a longer one is a prefill
EXACT_CHUNK_ROWS = 32  # oneDNN's bf16 kernel for 2-32 rows is one; on AMX it takes another from 33 (measured)


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed GEMM runs ``dtype`` here: fp32 wherever torch has oneDNN; bf16 only where oneDNN
    says the CPU can (AVX-512 or AMX: on an AVX2-only CPU its bf16 linear refuses to run)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() \
            or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class PackedLinear:
    """``y = x @ weight.T (+ bias)`` with the weight prepared for few-row calls; no autograd."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 dtype: torch.dtype | None = None, onednn: bool | None = None, exact_rows: bool = False) -> None:
        """``exact_rows``: a row's result does not depend on how many rows (up to ``MAX_EXACT_ROWS``) the call has.
        oneDNN's bf16 GEMM takes another kernel for one row than for 2-32 when K is large (K >= 1536 measured on
        AMD AVX-512 BF16: the down projection), and on an Intel Xeon with AMX another again from 33 rows (every K
        measured), each one bf16 ulp apart, and an ulp flips later greedy tokens: a verify of N rows would not be
        N plain steps. So with oneDNN a call runs in chunks of 2 to ``EXACT_CHUNK_ROWS`` rows, a lone row as two
        (the same row twice; as fast at one thread, measured); without it (``x @ w``, whose blocking follows the
        rows) each row runs alone."""
        weight = weight.detach().to(dtype or weight.dtype)  # [M, K]
        self.exact_rows = exact_rows
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.bias = None if bias is None else bias.detach().to(weight.dtype)  # [M]
        self.onednn = onednn_available(weight.device, weight.dtype) if onednn is None else onednn
        self.transposed = not self.onednn and weight.device.type == "cpu"
        if self.onednn:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ROWS_HINT)  # opaque [M, K]
        elif self.transposed:
            self.weight = weight.t().contiguous()  # [K, M]
        else:
            self.weight = weight  # [M, K]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., M]."""
        rows = x.reshape(-1, self.in_features)  # [N, K]
        if not self.exact_rows or rows.shape[0] > MAX_EXACT_ROWS:
            return self._gemm(x)
        if not self.onednn:
            return torch.cat([self._gemm(row[None]) for row in rows]).reshape(*x.shape[:-1], -1)  # [..., M]
        if rows.shape[0] <= EXACT_CHUNK_ROWS:
            return self._exact_chunk(rows).reshape(*x.shape[:-1], -1)  # [..., M]
        chunks = [self._exact_chunk(c) for c in rows.split(EXACT_CHUNK_ROWS)]  # each [<=32, M]
        return torch.cat(chunks).reshape(*x.shape[:-1], -1)  # [..., M]

    def _exact_chunk(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, K], 1 <= n <= EXACT_CHUNK_ROWS -> [n, M] through the 2-32-row kernel (a lone row twice)."""
        if rows.shape[0] == 1:
            return self._gemm(rows.expand(MIN_EXACT_ROWS, -1).contiguous())[:1]  # [2, K]: the row twice
        return self._gemm(rows)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., M], one call of the kernel."""
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


class _PackedLinearModule(nn.Module):
    """An inference-only stand-in for ``nn.Linear`` that runs a PackedLinear."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.packed = PackedLinear(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x)


def pack_linears(module: nn.Module) -> nn.Module:
    """A copy of ``module`` for inference whose ``nn.Linear`` layers run packed (same math, other
    GEMM kernel); the original, e.g. a draft in training, is untouched."""
    module = copy.deepcopy(module)
    for child in list(module.modules()):
        for attr, sub in list(child.named_children()):
            if type(sub) is nn.Linear:
                setattr(child, attr, _PackedLinearModule(sub))
    return module
