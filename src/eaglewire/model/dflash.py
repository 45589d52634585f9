"""The DFlash draft: a block draft, a pure nn.Module (no I/O).

Shapes: B batch, T context tokens, Q block queries (N blocks x bs positions), S keys,
H hidden size (= the target's), k number of aux boundaries, nH / nKV attention / key-value
heads, hd head dim, V target vocabulary, bs block size.

As z-lab's ``DFlashDraftModel`` (and SpecForge's, speculators' and the engines' readings of it)
defines it: the target's aux states are fused once, ``ctx = hidden_norm(fc(cat(aux)))``, and
every decoder layer attends from the block's positions to

- the context: ``k_norm(k_proj(ctx))`` / ``v_proj(ctx)`` of the tokens *before* the block's
  anchor (the fused state enters each layer's keys and values directly, no input norm), and
- the block itself, bidirectionally: ``input_layernorm`` of the block's hidden, then the
  layer's q/k/v with per-head ``q_norm`` / ``k_norm`` (Qwen3's attention).

A block at position p holds the anchor token (the last token the target produced, whose own
state is not known yet) and ``block_size - 1`` mask tokens; the output at block position j
predicts the token at p + j. Token embeddings and the output head are the target's (frozen),
passed in by the caller; this module owns ``fc``, ``hidden_norm``, ``layers`` and ``norm``.
Tensor names follow z-lab's checkpoint (``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eaglewire.model.draft import MLP, DraftConfig, RMSNorm, Rotary, apply_rope
from eaglewire.model.vocab import target_ids

FAMILY = "dflash"


@dataclass(kw_only=True)
class DFlashConfig:
    hidden_size: int
    target_hidden_size: int
    num_aux: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # target vocabulary V: the draft predicts with the target's own head
    block_size: int  # anchor + block_size - 1 drafted positions per pass
    mask_token_id: int  # the token whose (target) embedding fills the drafted positions
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    # Vd: the rows of the target's head the draft predicts over (the most frequent reply tokens, as speculators'
    # --draft-vocab-size); None or V: the whole vocabulary
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in [1, {self.vocab_size}] "
                             "(the target vocabulary)")
        if self.num_aux < 1:
            raise ValueError(f"num_aux must be >= 1, got {self.num_aux}")
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the anchor and at least one drafted position), "
                             f"got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the target vocabulary "
                             f"[0, {self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(f"a DFlash draft's hidden size is the target's ({self.target_hidden_size}), "
                             f"got {self.hidden_size}: it reads the target's embeddings and head")

    @property
    def pruned(self) -> bool:
        """Whether the draft predicts over part of the target's vocabulary (d2t / t2d maps)."""
        return self.draft_vocab_size < self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_target(cls, text_config, *, num_aux: int, vocab_size: int, num_layers: int, block_size: int,
                    mask_token_id: int, draft_vocab_size: int | None = None) -> DFlashConfig:
        """The draft's layers take the target's layer shape and RoPE (as the published drafts do)."""
        shape = DraftConfig.from_target(text_config, num_aux=num_aux, draft_vocab_size=vocab_size,
                                        vocab_size=vocab_size)
        return cls(hidden_size=shape.hidden_size, target_hidden_size=shape.target_hidden_size, num_aux=num_aux,
                   num_hidden_layers=num_layers, num_attention_heads=shape.num_attention_heads,
                   num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
                   intermediate_size=shape.intermediate_size, vocab_size=vocab_size, block_size=block_size,
                   mask_token_id=mask_token_id, rms_norm_eps=shape.rms_norm_eps, rope_theta=shape.rope_theta,
                   rope_parameters=shape.rope_parameters, max_position_embeddings=shape.max_position_embeddings,
                   draft_vocab_size=draft_vocab_size)


def default_mask_token_id(tokenizer, vocab_size: int) -> int:
    """The token the drafted positions read, as the published drafts choose it: a row of the
    embedding past the tokenizer's vocabulary where the table is padded (z-lab's Qwen3 drafts use
    ``len(tokenizer)``), else the tokenizer's mask token, else its highest-id special token that is
    neither BOS, EOS nor PAD nor in the chat template (never seen in a conversation)."""
    n = len(tokenizer)
    if n < vocab_size:
        return n
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    template = getattr(tokenizer, "chat_template", None) or ""
    candidates = [int(i) for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()
                  if getattr(tok, "special", False) and int(i) not in used and str(tok) not in template
                  and int(i) < vocab_size]
    if not candidates:
        raise ValueError("the tokenizer has no padded embedding row, no mask token and no unused special "
                         "token; pass --mask-token-id with a token id that never occurs in the data")
    return max(candidates)


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        H, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(H, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, H] -> k (normed, RoPE) / v [B, nKV, S, hd]."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim)).transpose(1, 2)  # [B, nKV, S, hd]
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nKV, S, hd]
        return apply_rope(k, cos, sin), v

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, Q, H] -> q (normed, RoPE) [B, nH, Q, hd]."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.num_heads, self.head_dim)).transpose(1, 2)  # [B, nH, Q, hd]
        return apply_rope(q, cos, sin)

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, nKV, S, hd] -> [B, nH, S, hd] (grouped-query attention)."""
        return x.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        B, _, Q, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(B, Q, -1))  # [B, Q, H]


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)  # the same gated SiLU MLP as the EAGLE-3 layer (field names alike)

    def forward(self, hidden: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        """hidden [B, Q, H]; ctx_k / ctx_v [B, nKV, S, hd]; cos/sin [B, Q, hd]; attn_mask [B or 1, 1, Q, S + Q]
        bool (True = attend). Returns [B, Q, H]."""
        attn_mod = self.self_attn

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys = torch.cat([ctx_k, k], dim=2)  # [B, nKV, S+Q, hd]
            values = torch.cat([ctx_v, v], dim=2)  # [B, nKV, S+Q, hd]
            return F.scaled_dot_product_attention(q, attn_mod.expand_kv(keys), attn_mod.expand_kv(values),
                                                  attn_mask=attn_mask)  # [B, nH, Q, hd]

        return self.block(hidden, cos, sin, attend)

    def block(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The layer over hidden [B, Q, H] (cos/sin [B, Q, hd]) with its attention left to ``attend``: (q [B, nH,
        Q, hd], the block's own k / v [B, nKV, Q, hd]) -> [B, nH, Q, hd], which knows where the context's keys are
        (``forward``: concatenated to the block's; decoding's static cache: written beside them)."""
        attn_mod = self.self_attn
        x = self.input_layernorm(hidden)
        q = attn_mod.q(x, cos, sin)
        k, v = attn_mod.kv(x, cos, sin)
        h = hidden + attn_mod.out(attend(q, k, v))
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    family = FAMILY

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.num_aux * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)
        # target id = draft id + d2t[draft id]; t2d[target id] = in the draft vocabulary (as EAGLE-3's maps).
        # The whole vocabulary: the identity, not stored (a checkpoint of such a draft holds no maps).
        pruned = config.pruned
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long), persistent=pruned)
        self.register_buffer("t2d", torch.full((config.vocab_size,), not pruned, dtype=torch.bool), persistent=pruned)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if not self.config.pruned:
            raise ValueError("a whole-vocabulary DFlash draft has no vocabulary maps to set")
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match draft vocab "
                             f"{self.config.draft_vocab_size} / target vocab {self.config.vocab_size}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[Vd] target token id of each draft id (the rows of the target's head the draft predicts over)."""
        return target_ids(self.d2t)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, k*Ht] -> ctx [B, T, H]."""
        return self.hidden_norm(self.fc(aux_hidden))

    def context_kv(self, ctx: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values of fused context ``ctx`` [B, T, H] at ``position_ids`` [B, T]:
        a list of (k, v) [B, nKV, T, hd]. Decoding caches these; they never change once computed."""
        cos, sin = self.rotary(position_ids, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward_blocks(self, block_emb: torch.Tensor, position_ids: torch.Tensor,
                       ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], attn_mask: torch.Tensor) -> torch.Tensor:
        """The blocks' output hidden states (after ``norm``), [B, Q, H].

        block_emb [B, Q, H] target embeddings of the block tokens (anchor, mask, ...); position_ids
        [B, Q]; ctx_kv per layer (k, v) [B, nKV, S, hd]; attn_mask [B or 1, 1, Q, S + Q] bool.
        """
        cos, sin = self.rotary(position_ids, block_emb.dtype)
        h = block_emb
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            h = layer(h, ck, cv, cos, sin, attn_mask)
        return self.norm(h)

    def draft_block(self, anchor_emb: torch.Tensor, mask_emb: torch.Tensor, position: int,
                    ctx_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Decoding: one block at ``position`` after all S cached context tokens.

        anchor_emb [B, H] the anchor's embedding; mask_emb [H] the mask token's. Returns the output
        hidden states of the drafted positions 1..bs-1, [B, bs-1, H] (position j predicts the token at
        ``position + j``).
        """
        B, bs = anchor_emb.shape[0], self.config.block_size
        S = ctx_kv[0][0].shape[2]
        block = torch.cat([anchor_emb[:, None], mask_emb.expand(B, bs - 1, -1)], dim=1)  # [B, bs, H]
        pos = torch.arange(position, position + bs, device=block.device).expand(B, bs)  # [B, bs]
        mask = torch.ones(1, 1, bs, S + bs, dtype=torch.bool, device=block.device)
        return self.forward_blocks(block, pos, ctx_kv, mask)[:, 1:]


def block_attention_mask(anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Training's mask for N parallel blocks per row: block n's queries see the context keys strictly
    before its anchor (the anchor's own state is not known when it is drafted) and all keys of their
    own block (bidirectional), nothing else.

    anchors [B, N] positions; keep [B, N] bool (a dropped block sees nothing and is not counted).
    Returns [B, 1, N*bs, T + N*bs] bool. A dropped block's rows attend to their own block so the
    softmax stays finite.
    """
    B, N = anchors.shape
    T, bs = context_len, block_size
    q_block = torch.arange(N * bs, device=anchors.device) // bs  # [Q]
    ctx = torch.arange(T, device=anchors.device)[None, None, :] < anchors.repeat_interleave(bs, dim=1)[:, :, None]  # [B, Q, T]
    ctx &= keep.repeat_interleave(bs, dim=1)[:, :, None]
    own = q_block[:, None] == q_block[None, :]  # [Q, Q]
    return torch.cat([ctx, own.expand(B, -1, -1)], dim=2)[:, None]  # [B, 1, Q, T+Q]
