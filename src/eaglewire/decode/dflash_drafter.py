"""A DFlash draft in the engine: one block pass per round, and the chain (or tree) it proposes.

Shapes: S context tokens cached, L draft layers, nKV key/value heads, hd head dim, H hidden,
k aux boundaries, bs block size, n drafted positions proposed (``--speculative-num-steps``),
V target vocabulary.

Positions (model/dflash.py): the context holds the fused target states of tokens 0..P-1, every
token the target has processed (prefill: the prompt; each round: the root and the accepted
drafts); the root, the last token the target produced, sits at P and anchors the block
[root, mask x (bs-1)] at positions P..P+bs-1, whose position j predicts the token at P+j: the
tree node of depth j. The draft predicts with the target's lm_head (its output is already
normed: not ``Target.head``, which would apply the target's final norm again).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from eaglewire.decode.attention import attend_biased, attention_bias
from eaglewire.decode.gemm import PackedLinear, pack_linears
from eaglewire.decode.kv_cache import widened
from eaglewire.decode.step_graphs import StepGraphs
from eaglewire.decode.tree import Tree, block_tree
from eaglewire.model.dflash import DFlashDraft
from eaglewire.model.dflash_blocks import head_rows, to_target_vocab
from eaglewire.model.target import Target


def check_block_steps(num_steps: int, block_size: int, flag: str) -> None:
    """A block drafts ``block_size - 1`` positions: more steps cannot be proposed."""
    if num_steps > block_size - 1:
        raise ValueError(f"{flag} {num_steps}: a DFlash draft of block size {block_size} drafts at most "
                         f"{block_size - 1} tokens per round; set {flag} {block_size - 1} or lower")


class DFlashContext:
    """Every draft layer's keys and values of the context, in position order 0..S-1."""

    def __init__(self) -> None:
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (k, v) [1, nKV, S, hd]

    @property
    def length(self) -> int:
        return 0 if not self.kv else self.kv[0][0].shape[2]

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not self.kv:
            self.kv = kv
            return
        self.kv = [(torch.cat([k0, k], dim=2), torch.cat([v0, v], dim=2)) for (k0, v0), (k, v) in zip(self.kv, kv)]


class StaticDFlashContext:
    """The context's keys and values at a fixed width W, every layer in one buffer [L, 1, nKV, W, hd]: token i at
    column i. A block pass writes its own bs keys at columns S..S+bs-1 (scratch: the next ``extend`` writes the
    context there) and attends to every column below S + bs through a bias, so its shapes never change: on CUDA one
    graph replays every round's block pass."""

    def __init__(self, draft: DFlashDraft, width: int, device: torch.device, dtype: torch.dtype) -> None:
        attn = draft.layers[0].self_attn
        shape = (len(draft.layers), 1, attn.num_kv_heads, width, attn.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, 1, nKV, W, hd]
        self.v = torch.zeros_like(self.k)
        self.columns = torch.arange(width, device=device)  # [W]
        self.length = 0

    @property
    def width(self) -> int:
        return self.k.shape[3]

    def reserve(self, columns: int) -> bool:
        """Room for ``columns``; True when the buffers moved (a graph that reads them must be captured again)."""
        k = widened(self.k, 3, columns)  # [L, 1, nKV, W', hd]
        if k is self.k:
            return False
        self.k, self.v = k, widened(self.v, 3, columns)
        self.columns = torch.arange(k.shape[3], device=k.device)
        return True

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each layer's (k, v) [1, nKV, n, hd] of the next n context tokens."""
        n = kv[0][0].shape[2]
        for layer, (k, v) in enumerate(kv):
            self.k[layer, :, :, self.length:self.length + n] = k
            self.v[layer, :, :, self.length:self.length + n] = v
        self.length += n


def static_block_pass(draft: DFlashDraft, context: StaticDFlashContext, anchor: torch.Tensor, mask_emb: torch.Tensor,
                      length: torch.Tensor) -> torch.Tensor:
    """One block anchored at position ``length`` (S, the context's length) over the static context: anchor [1, H]
    the anchor's embedding, mask_emb [H] -> the block's output states after ``norm``, [1, bs, H]. Its shapes depend
    on the block size alone (the context's length is a tensor), so a graph of it serves every round."""
    bs = draft.config.block_size
    attn = draft.layers[0].self_attn
    block = torch.cat([anchor[:, None], mask_emb.expand(1, bs - 1, -1)], dim=1)  # [1, bs, H]
    slots = length + torch.arange(bs, device=block.device)  # [bs]
    cos, sin = draft.rotary(slots[None], block.dtype)  # [1, bs, hd]
    seen = (context.columns < length + bs).expand(1, 1, bs, -1)  # [1, 1, bs, W]: the context and the whole block
    bias = attention_bias(seen, attn.num_heads // attn.num_kv_heads, block.dtype)  # [1, 1, G*bs, W]
    h = block
    for i, layer in enumerate(draft.layers):
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int = i) -> torch.Tensor:
            context.k[i].index_copy_(2, slots, k)  # [1, nKV, W, hd], the block at S..S+bs-1
            context.v[i].index_copy_(2, slots, v)
            return attend_biased(q, context.k[i], context.v[i], bias, attn.head_dim ** -0.5)  # [1, nH, bs, hd]

        h = layer.block(h, cos, sin, attend)  # [1, bs, H]
    return draft.norm(h)


class DFlashDrafter:
    """A DFlash draft's side of the decoding loop: ``start`` with the prompt's states, ``propose``
    a tree for the root at P, ``extend`` with the states of the tokens the target kept."""

    def __init__(self, target: Target, draft: DFlashDraft, *, num_steps: int, topk: int, num_draft_tokens: int,
                 min_score: float, steps_flag: str, static: bool | None = None) -> None:
        """``static``: the context in a fixed-width buffer and the block pass over it (``StaticDFlashContext``),
        replayed from a CUDA graph on CUDA; None: on CUDA. Elsewhere the context grows by concatenation."""
        check_block_steps(num_steps, draft.config.block_size, steps_flag)
        self.target, self.steps_flag, self.static = target, steps_flag, static
        self.draft = pack_linears(draft.to(target.device).eval())  # few-row GEMMs: see gemm.py
        self.dtype = next(draft.parameters()).dtype
        # the rows of the target's head the draft predicts over (all of them unless its vocabulary is pruned)
        weight, bias = head_rows(target, draft.draft_to_target if draft.config.pruned else None)
        self.lm_head = PackedLinear(weight, bias, dtype=self.dtype)  # H -> Vd
        self.num_steps, self.topk, self.num_draft_tokens, self.min_score = num_steps, topk, num_draft_tokens, min_score
        with torch.no_grad():
            mask_id = torch.tensor([draft.config.mask_token_id], device=target.device)
            self.mask_emb = target.embed_tokens(mask_id)[0].to(self.dtype)  # [H]
        self.context, self.graphs = self._new_context()

    def _new_context(self) -> tuple[DFlashContext | StaticDFlashContext, StepGraphs | None]:
        """An empty context, and the block pass's graphs where they replay (CUDA)."""
        device = self.target.device
        if not (device.type == "cuda" if self.static is None else self.static):
            return DFlashContext(), None
        graphs = StepGraphs(self._block_states, "DFlash's block pass") if device.type == "cuda" else None
        return StaticDFlashContext(self.draft, 2048, device, self.dtype), graphs

    def fork(self) -> DFlashDrafter:
        """A drafter for another sequence: the same packed draft and head, a context of its own."""
        other = copy.copy(self)
        other.context, other.graphs = other._new_context()  # its graphs record its own context's buffers
        return other

    def use_shape(self, spec) -> None:
        """Draft the next rounds in ``spec``'s shape (a SpecConfig: a schedule's choice for the live batch size)."""
        check_block_steps(spec.num_steps, self.draft.config.block_size, self.steps_flag)
        self.num_steps, self.topk, self.num_draft_tokens = spec.num_steps, spec.topk, spec.num_draft_tokens

    @torch.no_grad()
    def start(self, aux: torch.Tensor, next_tokens: list[int] | None = None, capacity: int = 0) -> None:
        """A new sequence: the context is the prompt's P tokens, aux [P, k*H]; room for ``capacity`` tokens in all
        (a static context reserved once, so no round moves it). ``next_tokens``: unused (the context is states
        alone; the loop's drafter interface)."""
        if isinstance(self.context, StaticDFlashContext):
            self.context.length = 0
            self._make_room(capacity)
        else:
            self.context = DFlashContext()
        self.extend(aux, next_tokens, 0)

    def _make_room(self, tokens: int) -> None:
        """A static context with room for ``tokens`` and a block after them; a buffer that moves has its graph
        captured again."""
        moved = self.context.reserve(tokens + self.draft.config.block_size)
        if moved and self.graphs is not None:
            self.graphs.clear()

    @torch.no_grad()
    def extend(self, aux: torch.Tensor, next_tokens: list[int] | None, start: int) -> None:
        """The fused states of the tokens the target processed at positions start..start+n-1, aux [n, k*H]
        (``next_tokens``: unused)."""
        if start != self.context.length:  # the context must stay exactly tokens 0..P-1
            raise RuntimeError(f"DFlash context holds {self.context.length} tokens, asked to add position {start}")
        ctx = self.draft.fuse(aux[None].to(self.dtype))  # [1, n, H]
        positions = torch.arange(start, start + aux.shape[0], device=ctx.device)[None]  # [1, n]
        if isinstance(self.context, StaticDFlashContext):
            self._make_room(start + aux.shape[0])  # a sequence longer than start() reserved for
        self.context.append(self.draft.context_kv(ctx, positions))

    @torch.no_grad()
    def block_logprobs(self, root: int, position: int) -> torch.Tensor:
        """One block pass anchored at ``root`` at ``position`` -> log-probabilities [n, V] of the
        tokens at position+1..position+n."""
        if position != self.context.length:  # the block sits right after the context (its keys follow them)
            raise RuntimeError(f"DFlash context holds {self.context.length} tokens, asked for a block at {position}")
        root_id = torch.tensor([root], device=self.target.device)  # [1]
        if isinstance(self.context, StaticDFlashContext):
            length = torch.tensor(position, device=self.target.device)  # []
            hidden = self._static_states(root_id, length)[0, 1:1 + self.num_steps]  # [n, H]
        else:
            anchor = self.target.embed_tokens(root_id).to(self.dtype)  # [1, H]
            states = self.draft.draft_block(anchor, self.mask_emb, position, self.context.kv)  # [1, bs-1, H]
            hidden = states[0, :self.num_steps]  # [n, H]
        return to_target_vocab(F.log_softmax(self.lm_head(hidden).float(), dim=-1), self.draft)  # [n, V]

    def _static_states(self, root_id: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """The block's states [1, bs, H] over the static context, from its graph on CUDA."""
        if self.graphs is not None:
            replayed = self.graphs.copies(0, root_id=root_id, length=length)
            if replayed is not None:
                return replayed[0]
            self.graphs = None
        return self._block_states(root_id, length)[0]

    def _block_states(self, root_id: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor]:
        """What the block pass's graph records: root_id [1], length [] -> (states [1, bs, H],)."""
        anchor = self.target.embed_tokens(root_id).to(self.dtype)  # [1, H]
        return (static_block_pass(self.draft, self.context, anchor, self.mask_emb, length),)

    def propose(self, root: int, position: int) -> Tree:
        """The tree to verify for the root at ``position`` (a chain when topk is 1)."""
        return block_tree(root, self.block_logprobs(root, position), self.topk, self.num_draft_tokens, self.min_score)
