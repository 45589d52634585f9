"""The EAGLE-3 draft: a pure nn.Module (no I/O).

Shapes: B batch, T tokens (queries), S cached tokens (keys), H draft hidden size,
Ht target hidden size, k number of aux boundaries, nH / nKV attention / key-value heads,
hd head dim, Vd draft vocabulary, V target vocabulary.

One decoder layer reads ``cat(input_layernorm(emb), hidden_norm(h))`` (2H wide q/k/v);
the residual is the un-normed ``h``; the layer's pre-norm output is both what ``norm`` +
``lm_head`` turn into draft logits and the ``h`` of the next drafting step. At step 0,
``h = fc(aux)`` fuses the target's k aux states. Tensor names follow SGLang's layout
(``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``). Token embeddings are
the target's (frozen), passed in by the caller, never stored here.

Two attention paths share the same weights and math:
- ``forward_ttt``: whole sequences during training-time test; step j's query at
  position t attends causally to step 0's keys and to the keys of steps 1..j at the
  same position only (the diagonal);
- ``forward_cached``: decoding, with a KV cache and an explicit mask (chains, trees).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eaglewire.model.ttt_attention import ttt_attention
from eaglewire.model.vocab import target_ids


@dataclass(kw_only=True)
class DraftConfig:
    hidden_size: int
    target_hidden_size: int
    num_aux: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # target vocabulary V
    draft_vocab_size: int  # Vd
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # beyond default RoPE (e.g. llama3, yarn)
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.num_aux < 1:
            raise ValueError(f"num_aux must be >= 1, got {self.num_aux}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in [1, {self.vocab_size}] "
                             "(the target vocabulary size)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftConfig:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_target(cls, text_config, *, num_aux: int, draft_vocab_size: int, vocab_size: int) -> DraftConfig:
        """The draft layer mirrors the target's layer shape and RoPE (as EAGLE-3 does)."""
        c = text_config
        heads = int(c.num_attention_heads)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        if getattr(c, "qk_nope_head_dim", None):  # MLA (DeepSeek): the draft uses plain attention
            head_dim = c.hidden_size // heads
        rope = dict(getattr(c, "rope_parameters", None) or {})
        if "full_attention" in rope:  # per-layer-type RoPE (Gemma 3): take the global one
            rope = dict(rope["full_attention"])
        theta = float(rope.pop("rope_theta", getattr(c, "rope_theta", 10000.0)))
        if rope.get("rope_type", "default") == "default":
            rope = {}
        return cls(hidden_size=int(c.hidden_size), target_hidden_size=int(c.hidden_size), num_aux=num_aux,
                   num_attention_heads=heads,
                   num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
                   head_dim=int(head_dim), intermediate_size=int(c.intermediate_size),
                   vocab_size=vocab_size, draft_vocab_size=draft_vocab_size,
                   rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)), rope_theta=theta,
                   rope_parameters=rope,
                   max_position_embeddings=int(getattr(c, "max_position_embeddings", 8192)))


class RMSNorm(nn.Module):
    """Llama's RMSNorm, normalised in fp32. On CUDA it is torch's fused kernel (forward and backward), in the
    input's dtype: a draft decoding in bf16 takes 4 kernels a step where the ops below took ~28, and training
    under bf16 autocast (fp32 weights, cast to the input's dtype as autocast casts a linear's) reads and writes
    each [B, T, H] activation once a norm instead of ~7 times in fp32. The kernel accumulates in fp32 and rounds
    once: a bf16 ulp from the ops below (which round the normalised value, then multiply), as the target's norm on
    CUDA (``decode/runner.rms_norm``). The CPU keeps the ops below."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x) if x.is_cuda else self.ops(x)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, weight.shape, weight, self.eps)

    def ops(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """RoPE tables for positions; default RoPE or any type transformers knows."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        if config.rope_parameters:
            from transformers import LlamaConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            params = {**config.rope_parameters, "rope_theta": config.rope_theta}
            cfg = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                              head_dim=config.head_dim, rope_parameters=params,
                              max_position_embeddings=config.max_position_embeddings)
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, None)
        else:
            dim = config.head_dim
            inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.scaling = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):
        """Moved with the draft, never cast: a bf16 inv_freq would shift every position's angle (positions reach
        thousands, bf16 keeps 8 bits), so a draft decoding in bf16 keeps its RoPE frequencies in fp32."""
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, hd]
        if self.scaling == 1.0:  # default RoPE: x * 1.0 is x, two kernels a step fewer
            return emb.cos().to(dtype), emb.sin().to(dtype)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, n, T, hd]; cos/sin [B, T, hd]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class Attention(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        H, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * H, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, H, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, 2H] -> q [B, nH, T, hd], k/v [B, nKV, T, hd] (RoPE applied)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nH, T, hd]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nKV, T, hd]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nKV, T, hd]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, nKV, S, hd] -> [B, nH, S, hd] (grouped-query attention)."""
        return x.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(B, T, -1))  # [B, T, H]


class MLP(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def attn_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual from the un-normed input, then the MLP block; returns the pre-norm output."""
        h = hidden + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.num_aux * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary = Rotary(config)
        # target id = draft id + d2t[draft id]; t2d[target id] = in the draft vocab.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool)
                             if config.draft_vocab_size == config.vocab_size
                             else torch.zeros(config.vocab_size, dtype=torch.bool))

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match draft vocab "
                             f"{self.config.draft_vocab_size} / target vocab {self.config.vocab_size}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[Vd] target token id of each draft id."""
        return target_ids(self.d2t)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, k*Ht] -> [B, T, H]."""
        return self.fc(aux_hidden)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> draft logits [B, T, Vd]."""
        return self.lm_head(self.norm(prenorm))

    def forward_ttt(self, emb: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                    cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One training-time-test step over whole sequences.

        emb [B, T, H] target embeddings of the input tokens; hidden [B, T, H] fused state
        (step 0) or the previous step's pre-norm output; position_ids [B, T]; ``cache``
        holds (k, v) of the earlier steps and gains this step's. Returns pre-norm [B, T, H].
        """
        layer = self.midlayer
        cos, sin = self.rotary(position_ids, emb.dtype)
        q, k, v = layer.self_attn.qkv(layer.attn_input(emb, hidden), cos, sin)
        cache.append((layer.self_attn.expand_kv(k), layer.self_attn.expand_kv(v)))
        attn = ttt_attention(q, [c[0] for c in cache], [c[1] for c in cache])  # [B, nH, T, hd]
        return layer.finish(hidden, layer.self_attn.out(attn))

    def forward_cached(self, emb: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                       past_k: torch.Tensor | None, past_v: torch.Tensor | None,
                       attn_mask: torch.Tensor | None):
        """Decoding step: T new tokens attend to S cached tokens and to each other.

        past_k/past_v [B, nKV, S, hd] or None; attn_mask [B or 1, 1, T, S+T] bool (True =
        attend) or None for causal among the new tokens. Returns (pre-norm [B, T, H],
        k [B, nKV, T, hd], v [B, nKV, T, hd]): the caller owns the cache.
        """
        layer = self.midlayer
        attn_mod = layer.self_attn
        cos, sin = self.rotary(position_ids, emb.dtype)
        q, k, v = attn_mod.qkv(layer.attn_input(emb, hidden), cos, sin)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)  # [B, nKV, S+T, hd]
        values = v if past_v is None else torch.cat([past_v, v], dim=2)  # [B, nKV, S+T, hd]
        if attn_mask is None:
            S, T = keys.shape[2] - k.shape[2], k.shape[2]
            attn_mask = torch.ones(T, S + T, dtype=torch.bool, device=k.device).tril(S)[None, None]
        attn = F.scaled_dot_product_attention(q, attn_mod.expand_kv(keys), attn_mod.expand_kv(values),
                                              attn_mask=attn_mask)  # [B, nH, T, hd]
        return layer.finish(hidden, attn_mod.out(attn)), k, v
