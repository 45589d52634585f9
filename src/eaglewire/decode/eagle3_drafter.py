"""An EAGLE-3 draft in the decoding loop: its context (the target's states of the accepted tokens) and the tree it
proposes each round, behind the loop's drafter interface (``start`` / ``propose`` / ``extend``, as DFlash's).

Shapes: P tokens in the target's cache, n context entries of one extension, H hidden, k aux boundaries, C
candidates of one level, F of them drafted, W the round's most columns.

The draft's context entry t pairs the target's fused state of token t with the embedding of token t+1 and sits
at position t, so a draft node of depth d runs at position P - 1 + d. Three ways to draft a round, the same
trees:

- the CPU's: the growing cache (``DraftCache``), a level at a time, attending over what is there;
- CUDA's with a floor on the path probability (``--draft-min-prob``): the fixed-width cache, each level's step
  replayed from its graph, a count read between levels;
- CUDA's without one: the whole round -- the last round's accepted tokens entered into the context, the root's
  top-k, every level -- replayed from one graph and read once (``draft_round``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from eaglewire.decode.draft_round import draft_round
from eaglewire.decode.gemm import pack_linears
from eaglewire.decode.kv_cache import DraftCache, StaticDraftCache, top_next
from eaglewire.decode.spec_config import SpecConfig
from eaglewire.decode.tree import Candidate, Tree, grow_tree, read_candidates, select_tree
from eaglewire.model.draft import Eagle3Draft
from eaglewire.model.target import Target

STATIC_WIDTH = 2048  # the fixed-width cache's first width (``start`` widens it to what a request needs)


class Eagle3Drafter:
    """``spec``: the loop's SpecConfig (num_steps, topk, num_draft_tokens, min_score). ``static``: the fixed-width
    cache (None: on CUDA); ``graphs``: its steps replayed from CUDA graphs (None: on CUDA)."""

    def __init__(self, target: Target, draft: Eagle3Draft, spec: SpecConfig, *, static: bool | None = None,
                 graphs: bool | None = None) -> None:
        self.target, self.spec = target, spec
        self.dtype = next(draft.parameters()).dtype
        self.draft = pack_linears(draft.to(target.device).eval())  # few-row GEMMs: see gemm.py
        self.draft_to_target = self.draft.draft_to_target
        self.static = target.device.type == "cuda" if static is None else static
        self.use_graphs = graphs
        self.cache = self._new_cache()
        self.whole_rounds = self.static and spec.min_score == float("-inf")  # fixed shapes: one graph a round
        self.root_out: torch.Tensor | None = None  # [1, 1, H] the last context entry's output, where it was run
        self.pending: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (ids [n], aux [n, k*H], start): the
        # entries the next whole round enters first

    def _new_cache(self) -> DraftCache | StaticDraftCache:
        if self.static:
            return StaticDraftCache(self.draft, STATIC_WIDTH, self.target.device, self.dtype, graphs=self.use_graphs)
        return DraftCache()

    def fork(self) -> Eagle3Drafter:
        """A drafter for another sequence: the same packed draft, a context (cache) of its own."""
        other = copy.copy(self)
        other.cache, other.root_out, other.pending = self._new_cache(), None, None
        return other

    def use_shape(self, spec: SpecConfig) -> None:
        """Draft the next rounds in ``spec``'s shape (a schedule's choice for the live batch size). On the fixed-width
        cache the floor decides whether a round is one graph, so there it stays the one the drafter was made with."""
        if self.static and spec.min_score != self.spec.min_score:
            raise ValueError(f"on {self.target.device} a schedule's shapes share the draft's --draft-min-prob "
                             f"{self.spec.min_prob}; got {spec.min_prob}")
        self.spec = spec

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids [n] on the target's device -> the draft's input embeddings [1, n, H]."""
        return self.target.embed_tokens(ids[None]).to(self.dtype)

    # -- the loop's interface ---------------------------------------------------

    @torch.no_grad()
    def start(self, aux: torch.Tensor, next_tokens: list[int], capacity: int) -> None:
        """A new sequence: the prompt's states aux [P, k*H], ``next_tokens`` the token after each (the prompt's
        tokens 1.. and the root); room for ``capacity`` entries in all (a static cache widened once, so no round
        moves it)."""
        if isinstance(self.cache, StaticDraftCache):
            self.cache.reset()
            self.cache.reserve(capacity)
        else:
            self.cache = DraftCache()
        self.root_out = self.pending = None
        self.extend(aux, next_tokens, 0)

    @torch.no_grad()
    def extend(self, aux: torch.Tensor, next_tokens: list[int], start: int) -> None:
        """Context entries at start..start+n-1: the target's states aux [n, k*H] and the token after each. A whole
        round enters a round's worth itself (``pending``: ``aux`` is kept until then, so it must be a tensor nothing
        overwrites, e.g. ``aux[path]``'s copy, not a graph's output buffer); anything else (a prompt) runs now."""
        ids = torch.tensor(next_tokens, device=self.target.device)  # [n]
        if self.whole_rounds and len(next_tokens) <= self.spec.num_draft_tokens:
            self.pending = (ids, aux, start)
            return
        hidden = self.draft.fuse(aux[None].to(self.dtype))  # [1, n, H]
        positions = torch.arange(start, start + len(next_tokens), device=hidden.device)[None]  # [1, n]
        out = self.cache.forward(self.draft, self.embed(ids), hidden, positions, None)  # [1, n, H]
        self.cache.commit()
        self.root_out = out[:, -1:]

    @torch.no_grad()
    def propose(self, root: int, position: int) -> Tree:
        """The tree to verify for ``root`` at ``position`` (= the context's length after what ``extend`` gave)."""
        spec = self.spec
        if self.whole_rounds:
            candidates = self._whole_round(position)
        else:
            levels = _DraftLevels(self.draft, self.cache, self.embed, self.root_out, position, spec)
            root_top = top_next(self.draft, self.root_out[0], spec.topk)  # ([1, k], [1, k])
            candidates = grow_tree(root_top, levels, spec.num_steps, spec.topk, self.draft_to_target, spec.min_score)
            self.cache.rollback()
        return select_tree(root, candidates, spec.num_draft_tokens, spec.min_score)[0]

    # -- whole rounds -----------------------------------------------------------

    def _whole_round(self, position: int) -> list[Candidate]:
        """``draft_round`` over the static cache, replayed from its graph per number of entries it adds (0: the
        first round after a prompt, whose entries already ran): one replay, one read."""
        spec, cache, dev = self.spec, self.cache, self.target.device
        if self.pending is not None:
            ids, aux, start = self.pending
            inputs, T = dict(ids=ids, aux=aux), ids.numel()
        else:
            start, T = cache.committed, 0
            inputs = dict(root_out=self.root_out)
        inputs["start"] = torch.tensor(start, device=dev)  # []
        if start + T != position:  # the context must end right before the root's position
            raise RuntimeError(f"the draft's context would hold {start + T} entries, the round is at {position}")
        cache.reserve(position + spec.num_steps * spec.topk)  # before the replay: a widened cache is captured anew
        packed, = cache.replay(f"round {spec.num_steps}x{spec.topk}", T, self._round_step, inputs)
        cache.length = cache.committed = position  # the round's scratch columns are masked until rewritten
        self.pending = None
        return read_candidates(packed)

    def _round_step(self, **inputs: torch.Tensor) -> tuple[torch.Tensor]:
        """What a round's graph records (the cache's current buffers)."""
        return draft_round(self.draft, self.embed, self.cache.k, self.cache.v, self.draft_to_target,
                           self.spec.num_steps, self.spec.topk, **inputs)


class _DraftLevels:
    """``grow_tree``'s ``children`` a level at a time: a level's best nodes run through the draft as one block
    (each attending to the committed context, its ancestors' scratch entries and itself), their states kept in
    the cache's scratch columns, the head's top-k read off their outputs; everything stays on the draft's
    device."""

    def __init__(self, draft, dcache: DraftCache | StaticDraftCache, embed: Callable[[torch.Tensor], torch.Tensor],
                 root_out: torch.Tensor, P: int, spec: SpecConfig) -> None:
        self.draft, self.dcache, self.embed, self.P, self.topk = draft, dcache, embed, P, spec.topk
        H, dev = root_out.shape[-1], root_out.device
        width = dcache.length + spec.num_steps * spec.topk  # the round's scratch never passes this
        self.hidden = root_out[0, :1].expand(spec.topk, H)  # [C, H] the state each candidate's logits came from
        rows = torch.zeros(1, width, dtype=torch.bool, device=dev)  # [1, W]
        rows[:, :dcache.committed] = True
        self.rows = rows.expand(spec.topk, width)  # [C, W] what each candidate's parent attends to

    def __call__(self, depth: int, order: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        F, S, dev = order.numel(), self.dcache.length, order.device
        rows = self.rows[order].clone()  # [F, W]
        slots = torch.arange(S, S + F, device=dev)  # [F] the scratch column each node's K/V goes to
        rows[torch.arange(F, device=dev), slots] = True  # each node attends to itself too
        hidden = self.hidden[order][None]  # [1, F, H]
        positions = torch.full((1, F), self.P - 1 + depth, device=dev)  # a node of depth d runs at P - 1 + d
        out, values, ids = self.dcache.forward_top(self.draft, self.embed(tokens), hidden, positions,
                                                   rows[None, None, :, :S + F], self.topk)  # [1, F, H], [F, k] x2
        self.hidden = out[0].repeat_interleave(self.topk, dim=0)  # [F*k, H]: the next level's candidates
        self.rows = rows.repeat_interleave(self.topk, dim=0)  # [F*k, W]
        return values, ids
