"""The speculative decoding loop: prefill -> draft -> verify -> accept, for one sequence.

Shapes: P tokens in the target's cache, N tree nodes, F frontier nodes of one draft level,
H hidden, k aux boundaries, V / Vd target / draft vocabulary.

Positions: the target's cache holds tokens 0..P-1; the root (the last token the target
produced, not yet in its cache) sits at position P and a tree node of depth d at P + d.
Without a draft the same loop verifies the root alone: plain decoding.

A draft is a ``Drafter``: an EAGLE-3 one (decode/eagle3_drafter.py) drafts a tree level by level
from its own context of the target's states; a DFlash one (decode/dflash_drafter.py) drafts one
block per round, anchored at the root at P, predicting the tokens at P+1..P+n. Their trees are
verified alike.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Protocol

import torch

from eaglewire.core.contract import HiddenStateContract
from eaglewire.core.generation import GenerationStats
from eaglewire.decode.dflash_drafter import DFlashDrafter
from eaglewire.decode.eagle3_drafter import Eagle3Drafter
from eaglewire.decode.runner import make_runner
from eaglewire.decode.sampling import MAX_NEW_TOKENS, SamplingParams, logits_to_probs, sample
from eaglewire.decode.spec_config import SpecConfig, spec_flag
from eaglewire.decode.tree import Tree
from eaglewire.decode.verify import greedy_verify, sampling_verify
from eaglewire.model.dflash import DFlashDraft
from eaglewire.model.draft import Eagle3Draft
from eaglewire.model.target import Target


class Drafter(Protocol):
    """A draft in the loop. Its context holds the target's states of the tokens before the root; ``next_tokens``
    are the token after each state (an EAGLE-3 draft's inputs; a DFlash draft's context is states alone)."""

    def start(self, aux: torch.Tensor, next_tokens: list[int], capacity: int) -> None:
        """A new sequence: the prompt's states aux [P, k*H]; room for ``capacity`` tokens in all."""

    def propose(self, root: int, position: int) -> Tree:
        """The tree to verify for ``root`` at ``position`` (the context's length)."""

    def extend(self, aux: torch.Tensor, next_tokens: list[int], start: int) -> None:
        """The states of the accepted tokens at start..start+n-1, aux [n, k*H]."""

    def fork(self) -> Drafter:
        """A drafter for another sequence (continuous batching): the same draft, a context of its own."""

    def use_shape(self, spec: SpecConfig) -> None:
        """Draft the next rounds in ``spec``'s shape."""


class SpecDecoder:
    """Speculative decoding of one sequence with a target and an (optional) EAGLE-3 or DFlash draft."""

    def __init__(self, target: Target, draft: Eagle3Draft | DFlashDraft | None = None,
                 contract: HiddenStateContract | None = None, spec: SpecConfig | None = None, *,
                 lean: bool | None = None) -> None:
        if draft is not None and contract is None:
            raise ValueError("a draft needs its hidden-state contract (load both with checkpoint.load_draft)")
        self.target, self.spec = target, spec or SpecConfig()
        self.boundaries = list(contract.aux_boundaries) if draft is not None else [target.num_layers]
        self.lean = lean  # None: the lean forward where the architecture has one
        self._target_runner = None  # made at the first request
        self.drafter: Drafter | None = None
        if isinstance(draft, DFlashDraft):
            self.drafter = DFlashDrafter(target, draft, num_steps=self.spec.num_steps, topk=self.spec.topk,
                                         num_draft_tokens=self.spec.num_draft_tokens, min_score=self.spec.min_score,
                                         steps_flag=spec_flag("num_steps"))
        elif draft is not None:
            self.drafter = Eagle3Drafter(target, draft, self.spec)
        self.stats = GenerationStats()

    def _runner(self):
        """One runner per decoder, reset per request: the lean runner's weight copies are
        made once, not per request (the engine serves one sequence at a time)."""
        if self._target_runner is None:
            self._target_runner = make_runner(self.target, self.boundaries, lean=self.lean)
        self._target_runner.reset()
        return self._target_runner

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
        sampling, gen = start_request(prompt_ids, max_new_tokens, sampling)
        stop_token_ids = stop_token_ids or set()
        stats = self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        drafter = self.drafter
        if drafter is not None:
            stats.position_accepts = [0] * self.spec.num_steps
        start = time.perf_counter()
        runner = self._runner()
        P = len(prompt_ids)
        runner.reserve(P + max_new_tokens + self.spec.num_draft_tokens)  # no step grows the cache
        last, aux = runner.forward(torch.tensor(prompt_ids), torch.arange(P), None)
        runner.commit(list(range(P)))
        root = next_token(runner.head(last[-1:]), sampling, gen)
        if drafter is not None:  # the context: tokens 0..P-1
            drafter.start(aux, prompt_ids[1:] + [root],
                          P + max_new_tokens + self.spec.num_steps * self.spec.topk + self.spec.num_draft_tokens)
        stats.prefill_seconds = time.perf_counter() - start
        produced: list[int] = []
        new = [root]
        while True:
            before = len(produced)
            finish = take_tokens(produced, new, max_new_tokens, stop_token_ids, should_stop)
            stats.new_tokens = len(produced)
            stats.total_seconds = time.perf_counter() - start
            if finish is not None:
                stats.finish_reason = finish
            if len(produced) > before:
                yield produced[before:]
            if finish is not None:
                return
            t0 = time.perf_counter()
            tree = root_only(root) if drafter is None else drafter.propose(root, P)
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
            if drafter is not None:
                drafter.extend(aux[path], accepted + [bonus], P)  # the root and the accepted drafts, at P..
                for d in range(len(accepted)):
                    stats.position_accepts[d] += 1
            stats.accept_lengths.append(len(path))
            stats.verified_lengths.append(len(tree))
            stats.draft_seconds += (t1 - t0) + (time.perf_counter() - t2)
            stats.verify_seconds += t2 - t1
            P += len(path)
            root = bonus
            new = accepted + [bonus]

    def generate(self, prompt_ids: list[int], **kwargs) -> tuple[list[int], GenerationStats]:
        tokens = [t for chunk in self.stream(prompt_ids, **kwargs) for t in chunk]
        return tokens, self.stats


def start_request(prompt_ids: list[int], max_new_tokens: int,
                  sampling: SamplingParams | None) -> tuple[SamplingParams, torch.Generator]:
    """A request checked (a prompt, a positive budget) -> its sampling settings and its generator, seeded with
    ``sampling.seed`` (a fresh seed without one)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty; give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    sampling = sampling or SamplingParams()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
    return sampling, gen


def next_token(logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator) -> int:
    """The token after a prompt from its last logits [.., V]: the first round's root."""
    if sampling.greedy:
        return int(logits[-1].argmax())
    return int(sample(logits_to_probs(logits[-1:], sampling).cpu(), gen)[0])


def take_tokens(produced: list[int], new: list[int], max_new_tokens: int, stop_token_ids: set[int],
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


def root_only(root: int) -> Tree:
    return Tree(tokens=torch.tensor([root]), parents=torch.tensor([-1]), depths=torch.tensor([0]),
                scores=torch.tensor([0.0]))
