"""The speculative decoding loop: prefill -> draft -> verify -> accept, for one sequence.

Shapes: P tokens in the target's cache, N tree nodes, F frontier nodes of one draft level,
H hidden, k aux boundaries, V / Vd target / draft vocabulary.

Positions: the target's cache holds tokens 0..P-1; the root (the last token the target
produced, not yet in its cache) sits at position P and a tree node of depth d at P + d.
The draft's context entry t pairs the target's fused state of token t with the embedding
of token t+1 and sits at position t, so a draft node of depth d runs at position P - 1 + d.
Without a draft the same loop verifies the root alone: plain decoding.

A DFlash draft (decode/dflash_drafter.py) drafts one block per round instead of one pass per
level: its context is the fused states of tokens 0..P-1 and its block, anchored at the root at P,
predicts the tokens at P+1..P+n; the tree it proposes is verified exactly as an EAGLE-3 one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from eaglewire.core.contract import HiddenStateContract
from eaglewire.core.generation import GenerationStats
from eaglewire.decode.dflash_drafter import DFlashDrafter
from eaglewire.decode.gemm import pack_linears
from eaglewire.decode.kv_cache import DraftCache, StaticDraftCache, top_next
from eaglewire.decode.runner import make_runner
from eaglewire.decode.sampling import MAX_NEW_TOKENS, SamplingParams, logits_to_probs, sample
from eaglewire.decode.tree import Tree, grow_tree, max_tree_tokens, select_tree
from eaglewire.decode.verify import greedy_verify, sampling_verify
from eaglewire.model.dflash import DFlashDraft
from eaglewire.model.draft import Eagle3Draft
from eaglewire.model.target import Target


@dataclass(kw_only=True)
class SpecConfig:
    """Named as SGLang names them: --speculative-num-steps / -eagle-topk / -num-draft-tokens.

    ``min_prob`` (``--draft-min-prob``, eaglewire's own) sets a least path probability (the
    product of the draft's probabilities from the root): drafting stops at a level whose nodes
    all fall below it and only nodes reaching it are verified, so a draft drafts deep where it is
    sure and verifies the root alone where it is not. 0 keeps SGLang's fixed shape.
    """

    # The one definition of the speculation flags: configs.add_config_args turns these fields
    # into generate's and serve's flags, bench's config strings parse into SpecConfigs.
    num_steps: int = field(default=5, metadata={
        "flag": "speculative-num-steps", "help": "draft steps per round (the tree's depth)"})
    topk: int = field(default=4, metadata={
        "flag": "speculative-eagle-topk", "help": "children drafted per node (1: a chain)"})
    num_draft_tokens: int = field(default=8, metadata={
        "flag": "speculative-num-draft-tokens", "help": "tree tokens verified per round, root included"})
    min_prob: float = field(default=0.0, metadata={
        "flag": "draft-min-prob",
        "help": "verify only draft tokens whose path probability reaches this; 0 = SGLang's fixed shape"})

    def __post_init__(self) -> None:
        check_spec_flags(self.num_steps, self.topk, self.num_draft_tokens)
        if not 0.0 <= self.min_prob < 1.0:
            raise ValueError(f"{spec_flag('min_prob')} must be in [0, 1) (0 = off), got {self.min_prob}")

    @classmethod
    def chain(cls, num_steps: int, *, min_prob: float = 0.0) -> SpecConfig:
        """A chain of ``num_steps`` drafted tokens (topk 1, so ``num_steps + 1`` verified)."""
        return cls(num_steps=num_steps, topk=1, num_draft_tokens=num_steps + 1, min_prob=min_prob)

    @property
    def min_score(self) -> float:
        """The least cumulative log-probability a drafted node needs."""
        return math.log(self.min_prob) if self.min_prob > 0 else -math.inf


def spec_flag(name: str) -> str:
    """The command-line flag of SpecConfig field ``name`` (``num_steps`` -> ``--speculative-num-steps``)."""
    return "--" + SpecConfig.__dataclass_fields__[name].metadata["flag"]


def check_spec_flags(num_steps: int, topk: int, num_draft_tokens: int) -> None:
    """Inconsistent flags are an error that says what to set, never a silent adjustment."""
    steps, k, tokens = spec_flag("num_steps"), spec_flag("topk"), spec_flag("num_draft_tokens")
    if num_steps < 1:
        raise ValueError(f"{steps} must be >= 1, got {num_steps}")
    if topk < 1:
        raise ValueError(f"{k} must be >= 1, got {topk}")
    if topk == 1 and num_draft_tokens != num_steps + 1:
        raise ValueError(
            f"{k} 1 drafts a chain of {steps} {num_steps} tokens, so "
            f"{tokens} must be {num_steps + 1} (got {num_draft_tokens}); set "
            f"{tokens} {num_steps + 1}, or {steps} {num_draft_tokens - 1}")
    most = max_tree_tokens(num_steps, topk)
    if not 2 <= num_draft_tokens <= most:
        raise ValueError(
            f"{tokens} {num_draft_tokens} is outside [2, {most}]: a tree of "
            f"{num_steps} steps with top-{topk} holds at most {most} tokens (root included); set "
            f"{tokens} to at most {most} or raise {steps}/{k.removeprefix('--speculative')}")


class SpecDecoder:
    """Speculative decoding of one sequence with a target and an (optional) EAGLE-3 or DFlash draft."""

    def __init__(self, target: Target, draft: Eagle3Draft | DFlashDraft | None = None,
                 contract: HiddenStateContract | None = None, spec: SpecConfig | None = None, *,
                 lean: bool | None = None) -> None:
        if draft is not None and contract is None:
            raise ValueError("a draft needs its hidden-state contract (load both with checkpoint.load_draft)")
        self.target, self.draft, self.spec = target, draft, spec or SpecConfig()
        self.boundaries = list(contract.aux_boundaries) if draft is not None else [target.num_layers]
        self.lean = lean  # None: the lean forward where the architecture has one
        self._target_runner = None  # made at the first request
        self._static_draft_cache: StaticDraftCache | None = None  # CUDA's, made at the first request
        self.dflash: DFlashDrafter | None = None  # a DFlash draft's block drafting and context
        if isinstance(draft, DFlashDraft):
            self.dflash = DFlashDrafter(target, draft, num_steps=self.spec.num_steps, topk=self.spec.topk,
                                        num_draft_tokens=self.spec.num_draft_tokens, min_score=self.spec.min_score,
                                        steps_flag=spec_flag("num_steps"))
            self.draft, self.draft_dtype = self.dflash.draft, self.dflash.dtype
            self.draft_to_target = self.draft.draft_to_target  # the identity: the target's own head
        elif draft is not None:
            self.draft_dtype = next(draft.parameters()).dtype
            self.draft = pack_linears(draft.to(target.device).eval())  # few-row GEMMs: see gemm.py
            self.draft_to_target = self.draft.draft_to_target
        self.stats = GenerationStats()

    # -- target side -------------------------------------------------------

    def _runner(self):
        """One runner per decoder, reset per request: the lean runner's weight copies are
        made once, not per request (the engine serves one sequence at a time)."""
        if self._target_runner is None:
            self._target_runner = make_runner(self.target, self.boundaries, lean=self.lean)
        self._target_runner.reset()
        return self._target_runner

    def _draft_cache(self) -> DraftCache | StaticDraftCache:
        """The CPU's growing cache; on CUDA the fixed-width one whose steps replay graphs, made once per decoder
        (its graphs are reused request after request)."""
        if self.draft is None or self.dflash is not None or self.target.device.type != "cuda":
            return DraftCache()
        if self._static_draft_cache is None:
            self._static_draft_cache = StaticDraftCache(self.draft, 2048, self.target.device, self.draft_dtype)
        self._static_draft_cache.reset()
        return self._static_draft_cache

    def _embed(self, tokens: list[int]) -> torch.Tensor:
        return self._embed_ids(torch.tensor(tokens, device=self.target.device))  # [1, n, H]

    def _embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids [n] on the target's device -> the draft's input embeddings [1, n, H]."""
        with torch.no_grad():
            return self.target.embed_tokens(ids[None]).to(self.draft_dtype)

    # -- draft side --------------------------------------------------------

    @torch.no_grad()
    def _extend_context(self, dcache: DraftCache | StaticDraftCache, aux: torch.Tensor, next_tokens: list[int], start: int) -> torch.Tensor:
        """Feed the target states of accepted tokens to the draft; return the last output [1, 1, H]."""
        n = len(next_tokens)
        hidden = self.draft.fuse(aux[None].to(self.draft_dtype))  # [1, n, H]
        positions = torch.arange(start, start + n, device=hidden.device)[None]  # [1, n]
        out = dcache.forward(self.draft, self._embed(next_tokens), hidden, positions, None)  # [1, n, H]
        dcache.commit()
        return out[:, -1:]

    @torch.no_grad()
    def _build_tree(self, root: int, root_out: torch.Tensor, dcache: DraftCache | StaticDraftCache, P: int) -> Tree:
        """Draft ``num_steps`` levels with the draft's KV cache; return the tree to verify. The levels are grown on
        the draft's device (``grow_tree``) and read once, when the tree is chosen."""
        spec = self.spec
        levels = _DraftLevels(self.draft, dcache, self._embed_ids, root_out, P, spec)
        root_top = top_next(self.draft, root_out[0], spec.topk)  # ([1, k], [1, k])
        candidates = grow_tree(root_top, levels, spec.num_steps, spec.topk, self.draft_to_target, spec.min_score)
        dcache.rollback()
        tree, _ = select_tree(root, candidates, spec.num_draft_tokens, spec.min_score)
        return tree

    # -- the loop ----------------------------------------------------------

    @torch.no_grad()
    def stream(self, prompt_ids: list[int], *, max_new_tokens: int = MAX_NEW_TOKENS,
               sampling: SamplingParams | None = None, stop_token_ids: set[int] | None = None,
               should_stop: Callable[[list[int]], bool] | None = None) -> Iterator[list[int]]:
        """Yield the new tokens of every round as they are accepted; stats land in ``self.stats``.

        Stops at a token of ``stop_token_ids`` (included in the output), when
        ``should_stop(all new tokens)`` says so (e.g. a stop string), or at ``max_new_tokens``,
        at exactly the token where plain decoding stops, also inside an accepted block.
        ``should_stop`` is asked once per new token, in order (so it may keep state, as
        ``text.StopStrings`` does).
        """
        if not prompt_ids:
            raise ValueError("the prompt is empty; give at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        sampling = sampling or SamplingParams()
        gen = torch.Generator(device="cpu")
        gen.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
        stop_token_ids = stop_token_ids or set()
        stats = self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        if self.draft is not None:
            stats.position_accepts = [0] * self.spec.num_steps
        start = time.perf_counter()
        runner = self._runner()
        P = len(prompt_ids)
        runner.reserve(P + max_new_tokens + self.spec.num_draft_tokens)  # no step grows the cache
        last, aux = runner.forward(torch.tensor(prompt_ids), torch.arange(P), None)
        runner.commit(list(range(P)))
        root = self._next_token(runner.head(last[-1:]), sampling, gen)
        dcache, root_out = self._draft_cache(), None
        dcache.reserve(P + max_new_tokens + self.spec.num_steps * self.spec.topk + self.spec.num_draft_tokens)
        if self.dflash is not None:
            self.dflash.start(aux, P + max_new_tokens + self.spec.num_draft_tokens)  # the context: tokens 0..P-1
        elif self.draft is not None:
            root_out = self._extend_context(dcache, aux, prompt_ids[1:] + [root], 0)
        stats.prefill_seconds = time.perf_counter() - start
        produced: list[int] = []
        new = [root]
        while True:
            before = len(produced)
            finish = _take(produced, new, max_new_tokens, stop_token_ids, should_stop)
            stats.new_tokens = len(produced)
            stats.total_seconds = time.perf_counter() - start
            if finish is not None:
                stats.finish_reason = finish
            if len(produced) > before:
                yield produced[before:]
            if finish is not None:
                return
            t0 = time.perf_counter()
            if self.dflash is not None:
                tree = self.dflash.propose(root, P)
            elif self.draft is not None:
                tree = self._build_tree(root, root_out, dcache, P)
            else:
                tree = _root_only(root)
            t1 = time.perf_counter()
            mask = None  # one token: plain causal attention
            if len(tree) > 1:
                mask = torch.ones(len(tree), P + len(tree), dtype=torch.bool)
                mask[:, P:] = tree.ancestor_mask()
            last, aux = runner.forward(tree.tokens, P + tree.depths, mask)
            logits = runner.head(last)  # [N, V]
            if sampling.greedy:
                path, bonus = greedy_verify(tree, logits.argmax(-1).cpu())
            else:
                path, bonus = sampling_verify(tree, logits_to_probs(logits, sampling).cpu(), gen)
            runner.commit(path)
            t2 = time.perf_counter()
            accepted = [int(tree.tokens[i]) for i in path[1:]]
            if self.dflash is not None:
                self.dflash.extend(aux[path], P)  # the root and the accepted drafts, at P..P+len(path)-1
            elif self.draft is not None:
                root_out = self._extend_context(dcache, aux[path], accepted + [bonus], P)
            if self.draft is not None:
                for d in range(len(accepted)):
                    stats.position_accepts[d] += 1
            stats.accept_lengths.append(len(path))
            stats.verified_lengths.append(len(tree))
            stats.draft_seconds += (t1 - t0) + (time.perf_counter() - t2)
            stats.verify_seconds += t2 - t1
            P += len(path)
            root = bonus
            new = accepted + [bonus]

    def _next_token(self, logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator) -> int:
        if sampling.greedy:
            return int(logits[-1].argmax())
        return int(sample(logits_to_probs(logits[-1:], sampling).cpu(), gen)[0])

    def generate(self, prompt_ids: list[int], **kwargs) -> tuple[list[int], GenerationStats]:
        tokens = [t for chunk in self.stream(prompt_ids, **kwargs) for t in chunk]
        return tokens, self.stats


def _take(produced: list[int], new: list[int], max_new_tokens: int, stop_token_ids: set[int],
          should_stop: Callable[[list[int]], bool] | None) -> str | None:
    """Append ``new`` to ``produced`` token by token, as plain decoding would produce them, up to
    the first token that ends generation; return the finish reason, or None to go on.

    Per token: a stop token or a completed stop string is "stop" (it wins over the limit
    reached at the same token), else the limit is "length". Tokens after it are dropped: an
    accepted block may run past where plain decoding stops.
    """
    for tok in new:
        produced.append(tok)
        if tok in stop_token_ids or (should_stop is not None and should_stop(produced)):
            return "stop"
        if len(produced) >= max_new_tokens:
            return "length"
    return None


class _DraftLevels:
    """``grow_tree``'s ``children`` for an EAGLE-3 draft: a level's best nodes run through the draft as one block
    (each attending to the committed context, its ancestors' scratch entries and itself), their states kept
    in the cache's scratch columns, the head's top-k read off their outputs; everything stays on the draft's
    device. Shapes: C candidates of the level, F of them drafted, W the round's most columns."""

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


def _root_only(root: int) -> Tree:
    return Tree(tokens=torch.tensor([root]), parents=torch.tensor([-1]), depths=torch.tensor([0]),
                scores=torch.tensor([0.0]))
