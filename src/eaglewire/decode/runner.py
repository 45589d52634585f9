"""Target runners for the engine: a KV-cached forward that also returns the contract's states.

Shapes: P tokens committed to the cache, N tokens of one block, H hidden, k aux
boundaries, V vocabulary, L layers, nH / nKV heads, hd head dim.

``HFRunner`` drives any transformers decoder through the shared ``capture`` (hooks).
``LeanRunner`` is a lean forward for Llama-family targets (Llama, Mistral, Qwen2, Qwen3):
fused projections, a preallocated cache, no per-step framework work; its boundary states
are the same residual-stream tensors (tests check it against ``capture`` and HF logits).
Both: ``forward`` writes the block's K/V after the committed prefix, ``commit(keep)``
keeps the accepted rows of that block and drops the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eaglewire.decode.attention import attend_biased, attend_rows, attention_bias, block_rows
from eaglewire.model.boundary_capture import capture
from eaglewire.decode.gemm import MAX_EXACT_ROWS, PackedLinear
from eaglewire.decode.kv_cache import compact_target_cache, widened
from eaglewire.decode.step_graphs import StepGraphs
from eaglewire.model.target import Target

LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class HFRunner:
    def __init__(self, target: Target, boundaries: list[int]) -> None:
        from transformers import DynamicCache

        self.target, self.boundaries = target, boundaries
        self.cache = DynamicCache(config=target.model.config)
        self.length = 0

    def reset(self) -> None:
        """Forget every token: the runner serves a new sequence."""
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.target.model.config)
        self.length = 0

    def reserve(self, tokens: int) -> None:
        """Nothing to reserve: transformers' cache grows as it goes."""

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None):
        """ids/positions [N]; mask [N, P+N] bool or None (causal) -> (last [N, H], aux [N, k*H])."""
        dev = self.target.device
        cap = capture(self.target, ids[None].to(dev), self.boundaries,
                      attention_mask=None if mask is None else mask[None, None].to(dev),
                      position_ids=positions[None].to(dev), past_key_values=self.cache, use_cache=True)
        return cap.last_hidden[0], cap.aux_hidden[0]

    def head(self, last: torch.Tensor) -> torch.Tensor:
        return self.target.head(last)

    def commit(self, keep: list[int]) -> None:
        compact_target_cache(self.cache, self.length, keep)
        self.length += len(keep)


def _norm(module: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """An HF RMSNorm's (weight, eps)."""
    eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", 1e-6)
    return module.weight.detach(), float(eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm in one fused op (fp32, and any dtype on CUDA, where the kernel accumulates in fp32 and
    rounds once: a bf16 ulp from HF's two roundings at most, and one kernel instead of seven -- a step is
    hundreds of small kernels); bf16 on CPU normalises in fp32 exactly as HF does."""
    if x.dtype == torch.float32 or x.is_cuda:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(rotary: torch.nn.Module, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's rotary module at ``positions`` [N] -> (cos, signed sin) [N, 1, hd] for ``_rotate``, once per
    forward: the sin's first half negated, which rotate-half RoPE applies to the second half of x (HF's rotary
    modules repeat one half's angles in the other, so only the sign differs)."""
    cos, sin = rotary(h[None], positions[None])  # [1, N, hd]
    half = sin.shape[-1] // 2
    signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # [1, N, hd]
    return cos[0, :, None], signed[0, :, None]  # [N, 1, hd]


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, x [N, n, hd]; cos/signed_sin [N, 1, hd] from ``rope``. The same values to the bit as
    ``x * cos + cat(-x2, x1) * sin`` (a sign moves between factors exactly), in one kernel fewer a layer: the
    halves swap by a roll rather than a negation and a concatenation."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def exact_rows(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a verify of N tokens must compute each row exactly as a plain step does (row-exact GEMMs, attention
    row by row): in bf16 a CPU kernel's row-to-row difference is an ulp, which flips later greedy tokens; fp32's
    (1e-7 relative) flipped none in the lossless tests. Not on CUDA: there a row at a time would cost a launch per
    row and a GEMM per row (a verify of 7 rows took 1.7x a plain step on an H200), and what a GPU gets instead --
    a batched verify whose bf16 rounding may differ from a one-row step -- is measured, not assumed: bench's "same
    as plain" column compares the outputs themselves."""
    return dtype != torch.float32 and device.type == "cpu"


class _Layer:
    """One decoder layer's weights, fused and packed: qkv [H -> (nH+2nKV)*hd], gate_up [H -> 2I]."""

    def __init__(self, layer, dtype: torch.dtype, exact: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        bias = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        self.qkv_proj = PackedLinear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                                     torch.cat(bias) if all(b is not None for b in bias) else None, dtype=dtype,
                                     exact_rows=exact)
        self.o_proj = PackedLinear(attn.o_proj.weight, dtype=dtype, exact_rows=exact)
        self.q_norm = _norm(attn.q_norm) if getattr(attn, "q_norm", None) is not None else None  # Qwen3
        self.k_norm = _norm(attn.k_norm) if getattr(attn, "k_norm", None) is not None else None
        self.gate_up = PackedLinear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), dtype=dtype,
                                    exact_rows=exact)
        self.down = PackedLinear(mlp.down_proj.weight, dtype=dtype, exact_rows=exact)
        self.ln1, self.ln2 = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, nH: int, nKV: int, hd: int):
        """h [N, H]; cos/signed_sin [N, 1, hd] (``rope``) -> q [nH, N, hd], k/v [nKV, N, hd], normed (Qwen3) and
        rotated."""
        N = h.shape[0]
        qkv = self.qkv_proj(rms_norm(h, *self.ln1)).view(N, nH + 2 * nKV, hd)  # [N, nH+2nKV, hd]
        if self.q_norm is not None:
            q = _rotate(rms_norm(qkv[:, :nH], *self.q_norm), cos, signed_sin)  # [N, nH, hd]
            k = _rotate(rms_norm(qkv[:, nH:nH + nKV], *self.k_norm), cos, signed_sin)  # [N, nKV, hd]
        else:  # q and k rotate together
            qk = _rotate(qkv[:, :nH + nKV], cos, signed_sin)  # [N, nH+nKV, hd]
            q, k = qk[:, :nH], qk[:, nH:]
        return q.transpose(0, 1), k.transpose(0, 1), qkv[:, nH + nKV:].transpose(0, 1)  # [heads, N, hd]

    def out_mlp(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """h [N, H] residual; attn [N, nH*hd] the heads' outputs -> h [N, H] after o_proj and the MLP."""
        h = h + self.o_proj(attn)  # [N, H]
        gate, up = self.gate_up(rms_norm(h, *self.ln2)).chunk(2, dim=-1)  # [N, I] each
        return h + self.down(F.silu(gate) * up)  # [N, H]


def has_lean_forward(target: Target) -> bool:
    """Whether the target's architecture has a lean forward (a model without a config, e.g. a
    scripted stand-in, has none)."""
    if getattr(target.model, "config", None) is None:
        return False
    return target.text_config.model_type in LEAN_MODEL_TYPES


class LeanWeights:
    """A Llama-family target prepared once for the lean forwards (``LeanRunner``,
    ``batched.BatchedDecoder``): packed layers and head, the shapes they need."""

    def __init__(self, target: Target) -> None:
        cfg = target.text_config
        if not has_lean_forward(target):
            raise ValueError(f"no lean forward for model type {cfg.model_type!r} (have: "
                             f"{', '.join(LEAN_MODEL_TYPES)}); use HFRunner or HF generate for this target")
        self.dtype, self.device = target.dtype, target.device
        self.exact_rows = exact_rows(self.dtype, self.device)  # a verify's rows computed as plain steps compute them
        self.layers = [_Layer(layer, self.dtype, self.exact_rows) for layer in target.layers]
        self.nH, self.nKV = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nH
        self.hidden, self.scale = cfg.hidden_size, self.hd ** -0.5
        self.embed = target.embed_tokens
        self.rotary = target.decoder.rotary_emb
        self.norm = target.decoder.norm
        self.lm_head = PackedLinear(target.model.get_output_embeddings().weight, dtype=self.dtype,
                                    exact_rows=self.exact_rows)  # H -> V

    def head(self, last: torch.Tensor) -> torch.Tensor:
        """[n, H] pre-norm -> logits [n, V]."""
        return self.lm_head(self.norm(last))


MAX_GRAPH_TOKENS = 64  # a forward of at most this many tokens (a step or a verify) replays a graph on CUDA


def static_mask(columns: torch.Tensor, length: torch.Tensor, slots: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Which cache columns each of a block's rows sees, over the whole cache: the committed ones (< ``length``)
    and, of the block's own (``slots``), those ``block`` allows. columns [S] = arange(S); length [] (P);
    slots [N] the block's columns; block [N, N] bool -> [N, S] bool."""
    committed = (columns < length).expand(slots.shape[0], -1)  # [N, S]
    return committed.index_copy(1, slots, block)  # [N, S]


class LeanRunner:
    """A lean KV-cached forward for Llama-family targets, sharing the target's weights.

    Two ways to run a block, the same math: the dynamic forward attends over the committed prefix and writes
    the block by slice (a prefill, and every CPU call); the static forward attends over the whole cache with a
    mask and writes the block by index, so its shapes depend only on the block's length -- on CUDA it is
    captured once per length and replayed (step_graphs.py), which is what makes a step cost its weights'
    streaming rather than its launches. ``static`` None: on CUDA.
    """

    def __init__(self, target: Target, boundaries: list[int], max_length: int = 2048, *,
                 static: bool | None = None, weights: LeanWeights | None = None) -> None:
        """``weights``: the target's packed weights when another runner made them (a batch of sequences shares
        one copy)."""
        self.w = w = weights or LeanWeights(target)
        self.boundaries = boundaries
        self.k_cache = torch.zeros(len(w.layers), w.nKV, max_length, w.hd, dtype=w.dtype, device=w.device)  # [L, nKV, S, hd]
        self.v_cache = torch.zeros_like(self.k_cache)
        self.columns = torch.arange(max_length, device=w.device)  # [S]
        self.length = 0
        self.static = w.device.type == "cuda" if static is None else static
        self.graphs = StepGraphs(self._static_forward, "the target's step") if self.static and w.device.type == "cuda" else None

    def reset(self) -> None:
        """Forget every token: the runner (and its packed weights) serves a new sequence."""
        self.length = 0

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` cache columns now, so no step of the sequence grows the cache (a growth moves
        it: every captured graph is recaptured)."""
        self._grow(tokens)

    def _grow(self, need: int) -> None:
        k_cache = widened(self.k_cache, 2, need)  # [L, nKV, S', hd]
        if k_cache is self.k_cache:
            return
        self.k_cache, self.v_cache = k_cache, widened(self.v_cache, 2, need)
        self.columns = torch.arange(k_cache.shape[2], device=k_cache.device)
        if self.graphs is not None:
            self.graphs.clear()

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None):
        """ids/positions [N]; mask [N, P+N] bool or None (causal) -> (last [N, H], aux [N, k*H])."""
        dev = self.k_cache.device
        N, P = ids.numel(), self.length
        self._grow(P + N)
        if self.static and N <= MAX_GRAPH_TOKENS:
            block = torch.ones(N, N, dtype=torch.bool).tril() if mask is None else mask[:, P:].cpu()  # [N, N]
            inputs = dict(ids=ids.to(dev), positions=positions.to(dev), slots=torch.arange(P, P + N, device=dev),
                          length=torch.tensor(P, device=dev), block=block.to(dev))
            if self.graphs is not None:
                replayed = self.graphs.copies(N, **inputs)  # (last, aux), keyed by the block's tokens
                if replayed is not None:
                    return replayed
                self.graphs = None
            return self._static_forward(**inputs)
        return self._dynamic_forward(ids.to(dev), positions.to(dev), None if mask is None else mask.to(dev))

    def _dynamic_forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None):
        """The block attends over the committed prefix only, written by slice (shapes follow P)."""
        return forward_blocks([self], [(ids, positions, mask)])[0]

    def _static_forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, length: torch.Tensor,
                        block: torch.Tensor):
        """The block attends over the whole cache through a mask and is written by index: its shapes depend on N
        alone. ids/positions/slots [N]; length [] (P); block [N, N] bool -> (last [N, H], aux [N, k*H])."""
        w = self.w
        N = ids.shape[0]
        h = w.embed(ids)  # [N, H]
        cos, signed_sin = rope(w.rotary, h, positions)  # [N, 1, hd]
        mask = static_mask(self.columns, length, slots, block)[None]  # [1, N, S]
        bias = attention_bias(mask, w.nH // w.nKV, w.dtype)  # [1, G*N, S], for every layer
        seen: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(w.layers):
            seen[i] = h
            q, k, v = layer.qkv(h, cos, signed_sin, w.nH, w.nKV, w.hd)  # [nH|nKV, N, hd]
            self.k_cache[i].index_copy_(1, slots, k)  # [nKV, S, hd]
            self.v_cache[i].index_copy_(1, slots, v)
            attn = attend_biased(q, self.k_cache[i], self.v_cache[i], bias, w.scale)  # [nH, N, hd]
            h = layer.out_mlp(h, attn.transpose(0, 1).reshape(N, w.nH * w.hd))  # [N, H]
        seen[len(w.layers)] = h
        return h, torch.cat([seen[b] for b in self.boundaries], dim=-1)  # [N, H], [N, k*H]

    def head(self, last: torch.Tensor) -> torch.Tensor:
        return self.w.head(last)  # [n, V]

    def commit(self, keep: list[int]) -> None:
        P = self.length
        if keep != list(range(len(keep))):
            idx = torch.tensor(keep, device=self.k_cache.device) + P
            self.k_cache[:, :, P:P + len(keep)] = self.k_cache[:, :, idx]
            self.v_cache[:, :, P:P + len(keep)] = self.v_cache[:, :, idx]
        self.length = P + len(keep)


Block = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # ids [n], positions [n], mask [n, P+n] or None


def forward_blocks(runners: list[LeanRunner], blocks: list[Block]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each runner's block after its own committed prefix, all in one pass: continuous batching's target forward.
    ``blocks[b]``: ids/positions [n_b]; mask [n_b, P_b+n_b] bool or None (causal) -> per runner (last [n_b, H],
    aux [n_b, k*H]).

    The runners share one ``LeanWeights`` and their boundaries. The blocks' rows are packed into one GEMM per
    weight matrix (N = sum n_b rows: a decode step streams the weights once for every sequence); attention runs per
    sequence over its own cache, so ragged lengths need no padding. A single runner's block runs exactly its own
    forward (no packing copies). bf16 on CPU: a block's rows attend one at a time (``attend_rows``) and the GEMMs
    are row-exact up to ``MAX_EXACT_ROWS`` rows in all, so each row is what it would be alone."""
    w = runners[0].w
    assert all(r.w is w for r in runners), "a batch of runners shares one LeanWeights"
    dev, sizes = w.device, [ids.numel() for ids, _, _ in blocks]
    N = sum(sizes)
    for runner, n in zip(runners, sizes):
        runner._grow(runner.length + n)
    ids = _packed([ids.to(dev) for ids, _, _ in blocks])  # [N]
    h = w.embed(ids)  # [N, H]
    cos, signed_sin = rope(w.rotary, h, _packed([p.to(dev) for _, p, _ in blocks]))  # [N, 1, hd]
    plans = [_attention_plan(w, runner.length, n, None if mask is None else mask.to(dev))
             for runner, n, (_, _, mask) in zip(runners, sizes, blocks)]
    seen: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(w.layers):
        seen[i] = h
        q, k, v = layer.qkv(h, cos, signed_sin, w.nH, w.nKV, w.hd)  # [nH|nKV, N, hd]
        outs, o = [], 0
        for runner, n, (rows, bias) in zip(runners, sizes, plans):
            P = runner.length
            runner.k_cache[i, :, P:P + n] = k[:, o:o + n]
            runner.v_cache[i, :, P:P + n] = v[:, o:o + n]
            if rows is not None:
                outs.append(attend_rows(q[:, o:o + n], runner.k_cache[i], runner.v_cache[i], P, rows, w.scale))
            else:
                keys, values = runner.k_cache[i, :, :P + n], runner.v_cache[i, :, :P + n]  # [nKV, P+n, hd]
                outs.append(attend_biased(q[:, o:o + n], keys, values, bias, w.scale))  # [nH, n, hd]
            o += n
        attn = _packed(outs, dim=1)  # [nH, N, hd]
        h = layer.out_mlp(h, attn.transpose(0, 1).reshape(N, w.nH * w.hd))  # [N, H]
    seen[len(w.layers)] = h
    aux = torch.cat([seen[b] for b in runners[0].boundaries], dim=-1)  # [N, k*H]
    return list(zip(h.split(sizes), aux.split(sizes)))


def _packed(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``parts`` concatenated along ``dim``; one part is itself (a single sequence's forward copies nothing)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _attention_plan(w: LeanWeights, P: int, n: int, mask: torch.Tensor | None):
    """How a block of ``n`` rows after ``P`` committed ones attends, prepared once for every layer: (rows for
    ``attend_rows``, None) where a verify's rows must be computed one at a time (bf16 on CPU), else (None, the
    additive bias [1, G*n, P+n] or None for all keys)."""
    if w.exact_rows and 1 < n <= MAX_EXACT_ROWS:
        return block_rows(mask, P, n), None
    if mask is not None:
        mask = mask[None]  # [1, n, P+n]
    elif n > 1:
        mask = torch.ones(n, P + n, dtype=torch.bool, device=w.device).tril(P)[None]  # causal block
    return None, attention_bias(mask, w.nH // w.nKV, w.dtype)  # [1, G*n, P+n] or None


def make_runner(target: Target, boundaries: list[int], *, lean: bool | None = None):
    """The lean forward where the architecture allows it (or when asked), else HF's."""
    if lean is None:
        lean = has_lean_forward(target)
    return LeanRunner(target, boundaries) if lean else HFRunner(target, boundaries)
