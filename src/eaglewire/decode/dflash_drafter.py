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

import torch
import torch.nn.functional as F

from eaglewire.decode.gemm import PackedLinear, pack_linears
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


class DFlashDrafter:
    """A DFlash draft's side of the decoding loop: ``start`` with the prompt's states, ``propose``
    a tree for the root at P, ``extend`` with the states of the tokens the target kept."""

    def __init__(self, target: Target, draft: DFlashDraft, *, num_steps: int, topk: int, num_draft_tokens: int,
                 min_score: float, steps_flag: str) -> None:
        check_block_steps(num_steps, draft.config.block_size, steps_flag)
        self.target = target
        self.draft = pack_linears(draft.to(target.device).eval())  # few-row GEMMs: see gemm.py
        self.dtype = next(draft.parameters()).dtype
        # the rows of the target's head the draft predicts over (all of them unless its vocabulary is pruned)
        weight, bias = head_rows(target, draft.draft_to_target if draft.config.pruned else None)
        self.lm_head = PackedLinear(weight, bias, dtype=self.dtype)  # H -> Vd
        self.num_steps, self.topk, self.num_draft_tokens, self.min_score = num_steps, topk, num_draft_tokens, min_score
        with torch.no_grad():
            mask_id = torch.tensor([draft.config.mask_token_id], device=target.device)
            self.mask_emb = target.embed_tokens(mask_id)[0].to(self.dtype)  # [H]
        self.context = DFlashContext()

    @torch.no_grad()
    def start(self, aux: torch.Tensor) -> None:
        """A new sequence: the context is the prompt's P tokens, aux [P, k*H]."""
        self.context = DFlashContext()
        self.extend(aux, 0)

    @torch.no_grad()
    def extend(self, aux: torch.Tensor, start: int) -> None:
        """The fused states of the tokens the target processed at positions start..start+n-1, aux [n, k*H]."""
        if start != self.context.length:  # the context must stay exactly tokens 0..P-1
            raise RuntimeError(f"DFlash context holds {self.context.length} tokens, asked to add position {start}")
        ctx = self.draft.fuse(aux[None].to(self.dtype))  # [1, n, H]
        positions = torch.arange(start, start + aux.shape[0], device=ctx.device)[None]  # [1, n]
        self.context.append(self.draft.context_kv(ctx, positions))

    @torch.no_grad()
    def block_logprobs(self, root: int, position: int) -> torch.Tensor:
        """One block pass anchored at ``root`` at ``position`` -> log-probabilities [n, V] of the
        tokens at position+1..position+n."""
        anchor = self.target.embed_tokens(torch.tensor([root], device=self.target.device)).to(self.dtype)  # [1, H]
        hidden = self.draft.draft_block(anchor, self.mask_emb, position, self.context.kv)[0, :self.num_steps]  # [n, H]
        return to_target_vocab(F.log_softmax(self.lm_head(hidden).float(), dim=-1), self.draft)  # [n, V]

    def propose(self, root: int, position: int) -> Tree:
        """The tree to verify for the root at ``position`` (a chain when topk is 1)."""
        return block_tree(root, self.block_logprobs(root, position), self.topk, self.num_draft_tokens, self.min_score)
