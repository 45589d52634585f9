"""Continuous batching: many sequences decoded together, joining and leaving between steps.

Terms: a *sequence* is one request's generation. A *step* advances every live sequence once: either a plain step
(each verifies its root alone) or a speculative round (each drafts its own tree; one target pass verifies every
sequence's tree, each accepting its own prefix). The ``Schedule`` picks which, and the shape, by the live batch size.

Shapes: B live sequences, n_b tokens of sequence b's block (1 plain, its tree's size speculating), P_b tokens in its
cache, H hidden, k aux boundaries, V vocabulary.

Each sequence owns its target cache (a ``LeanRunner`` sharing the engine's packed weights; ``forward_blocks`` packs
the blocks of all of them into one pass) and, with a draft, its drafter (a fork of the loaded one: the draft's
weights shared, its context its own). The target's states of the tokens a sequence decoded plainly wait in
``Sequence.unseen`` and enter its draft's context at its next speculative round, so plain steps cost the draft
nothing. Greedy output is the target's: with a draft or without, at any batch size (fp32: up to the GEMM's rounding,
which can depend on the number of rows; bf16 on CPU: row-exact up to 64 rows, runner.forward_blocks and gemm.PackedLinear).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from eaglewire.core.generation import GenerationStats
from eaglewire.decode.eagle3_batch import can_batch, draft_chains, extend_together
from eaglewire.decode.runner import HFRunner, LeanRunner, LeanWeights, forward_blocks, has_lean_forward, make_runner
from eaglewire.decode.sampling import SamplingParams, logits_to_probs
from eaglewire.decode.spec_config import SpecConfig
from eaglewire.decode.spec_decoder import Drafter, SpecDecoder, next_token, root_only, start_request, take_tokens
from eaglewire.decode.tree import Tree
from eaglewire.decode.verify import greedy_verify, sampling_verify

FIRST_CACHE_COLUMNS = 256  # a new sequence's cache starts this wide and doubles as it needs


class ShapeSchedule(Protocol):
    """What the loop asks of a schedule: the shape a step of ``batch`` live sequences runs (None: plain). tune's
    measured ``Schedule`` (concurrency/schedule.py) is one; ``OneShape`` is the loop's own default."""

    def shape_for(self, batch: int) -> SpecConfig | None: ...

    @property
    def shapes(self) -> list[SpecConfig]: ...

    @property
    def max_steps(self) -> int: ...


@dataclass(frozen=True)
class OneShape:
    """One shape (or plain) at every batch size: what a decoder runs without a schedule."""

    shape: SpecConfig | None

    def shape_for(self, batch: int) -> SpecConfig | None:
        return self.shape

    @property
    def shapes(self) -> list[SpecConfig]:
        return [] if self.shape is None else [self.shape]

    @property
    def max_steps(self) -> int:
        return 0 if self.shape is None else self.shape.num_steps


@dataclass(eq=False)
class Sequence:
    """One request's generation in the batch."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: set[int]
    should_stop: Callable[[list[int]], bool] | None
    slot: _Slot
    generator: torch.Generator
    stats: GenerationStats
    root: int = 0  # the last token the target produced, not yet in its cache
    produced: list[int] = field(default_factory=list)  # the output so far
    new: list[int] = field(default_factory=list)  # what the last step added to ``produced``
    finish_reason: str | None = None  # set when it ended
    started: float = 0.0
    unseen: list[tuple[torch.Tensor, list[int], int]] = field(default_factory=list)  # (aux [n, k*H], next tokens,
    # start): context entries the draft has not had yet
    drafting: bool = False  # the drafter holds the context up to ``unseen``

    @property
    def length(self) -> int:
        """Tokens in the target's cache (the root's position)."""
        return self.slot.runner.length

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class _Slot:
    """A target cache and (with a draft) a drafter, kept for the next sequence when one ends."""

    runner: LeanRunner | HFRunner
    drafter: Drafter | None


class BatchEngine:
    """The decoding loop of many sequences at once over a ``SpecDecoder``'s target and draft; one thread drives it
    (``add``, ``step``, ``remove``)."""

    def __init__(self, decoder: SpecDecoder, schedule: ShapeSchedule | None = None) -> None:
        self.decoder, self.target = decoder, decoder.target
        self.has_draft = decoder.drafter is not None
        self.schedule = engine_schedule(decoder, schedule)
        self.max_steps = self.schedule.max_steps
        self.lean = has_lean_forward(self.target) if decoder.lean is None else decoder.lean
        self.weights: LeanWeights | None = None  # packed at the first request, on the thread that drives the engine
        self.live: list[Sequence] = []
        self._free: list[_Slot] = []
        self.last_shape: SpecConfig | None = None  # what the last step ran (None: plain)

    # -- sequences join and leave --------------------------------------------

    @torch.no_grad()
    def add(self, prompt_ids: list[int], *, max_new_tokens: int, sampling: SamplingParams | None = None,
            stop_token_ids: set[int] | None = None,
            should_stop: Callable[[list[int]], bool] | None = None) -> Sequence:
        """Prefill a new sequence and take its first token (``seq.new``); it joins the batch unless that token
        already ended it. Stops as ``SpecDecoder.stream`` does."""
        sampling, generator = start_request(prompt_ids, max_new_tokens, sampling)
        seq = Sequence(list(prompt_ids), max_new_tokens, sampling, stop_token_ids or set(), should_stop,
                       self._slot(), generator, GenerationStats(prompt_tokens=len(prompt_ids)),
                       started=time.perf_counter())
        seq.stats.position_accepts = [0] * self.max_steps
        runner, P = seq.slot.runner, len(prompt_ids)
        runner.reset()
        runner.reserve(min(P + max_new_tokens, P + FIRST_CACHE_COLUMNS))
        last, aux = runner.forward(torch.tensor(prompt_ids), torch.arange(P), None)
        runner.commit(list(range(P)))
        logits = runner.head(last[-1:])  # [1, V]
        seq.root = next_token(logits, sampling, generator)
        if self.has_draft:
            seq.unseen.append((aux, prompt_ids[1:] + [seq.root], 0))
        seq.stats.prefill_seconds = time.perf_counter() - seq.started
        self._take(seq, [seq.root])
        if not seq.finished:
            self.live.append(seq)
        else:
            self._release(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of the batch (a cancelled request); its cache goes to the next sequence."""
        if seq in self.live:
            self.live.remove(seq)
            self._release(seq)

    def _slot(self) -> _Slot:
        if self._free:
            return self._free.pop()
        decoder = self.decoder
        if self.lean:
            self.weights = self.weights or LeanWeights(self.target)
            runner = LeanRunner(self.target, decoder.boundaries, FIRST_CACHE_COLUMNS, weights=self.weights)
        else:
            runner = make_runner(self.target, decoder.boundaries, lean=False)
        return _Slot(runner, decoder.drafter.fork() if self.has_draft else None)

    def _release(self, seq: Sequence) -> None:
        seq.unseen.clear()
        self._free.append(seq.slot)

    # -- one step of every live sequence ---------------------------------------

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """Advance every live sequence once; returns them, each with its new tokens in ``new``. Those that ended
        (``finished``) have left the batch."""
        live = list(self.live)
        if not live:
            return []
        shape = self.last_shape = self.schedule.shape_for(len(live))
        t0 = time.perf_counter()
        trees = self._propose(live, shape)
        t1 = time.perf_counter()
        blocks = [(tree.tokens, seq.length + tree.depths, _tree_mask(tree, seq.length)) for seq, tree in zip(live, trees)]
        outputs = self._forward([seq.slot.runner for seq in live], blocks)
        logits = self._head([last for last, _ in outputs]).split([len(t) for t in trees])  # [n_b, V] each
        t2 = time.perf_counter()
        extends = [self._settle(seq, tree, aux, seq_logits)
                   for seq, tree, (_, aux), seq_logits in zip(live, trees, outputs, logits)]
        self._extend([seq for seq, e in zip(live, extends) if e is not None], [e for e in extends if e is not None])
        t3 = time.perf_counter()
        for seq in live:  # the step's time, shared: drafting (proposing and extending) and the one verify pass
            seq.stats.draft_seconds += (t1 - t0 + t3 - t2) / len(live)
            seq.stats.verify_seconds += t2 - t1
        for seq in live:
            if seq.finished:
                self.live.remove(seq)
                self._release(seq)
        return live

    def _propose(self, live: list[Sequence], shape: SpecConfig | None) -> list[Tree]:
        """The tree each sequence verifies this step: its root alone (plain), or its draft's in ``shape`` -- chains
        of EAGLE-3 drafts on the CPU drafted together (eagle3_batch.py), anything else one drafter at a time."""
        if shape is None:
            return [root_only(seq.root) for seq in live]
        for seq in live:
            seq.slot.drafter.use_shape(shape)
            self._catch_up(seq, shape)
        drafters = [seq.slot.drafter for seq in live]
        if shape.topk == 1 and can_batch(drafters):
            return draft_chains(drafters, [seq.root for seq in live], [seq.length for seq in live], shape.num_steps,
                                shape.min_score)
        return [drafter.propose(seq.root, seq.length) for seq, drafter in zip(live, drafters)]

    def _catch_up(self, seq: Sequence, shape: SpecConfig) -> None:
        """Give the draft the context entries it has not seen (the prompt's, and those of plain steps)."""
        if not seq.unseen:
            return
        aux = torch.cat([a for a, _, _ in seq.unseen])  # [n, k*H]
        tokens = [t for _, ts, _ in seq.unseen for t in ts]
        start = seq.unseen[0][2]
        seq.unseen.clear()
        drafter = seq.slot.drafter
        if not seq.drafting:
            room = seq.length + seq.max_new_tokens + shape.num_steps * shape.topk + shape.num_draft_tokens
            drafter.start(aux, tokens, room)
            seq.drafting = True
        else:
            drafter.extend(aux, tokens, start)

    def _forward(self, runners: list, blocks: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every runner's block: one packed pass over the lean runners; one sequence (or HF's runners) each
        through its own forward (on CUDA a single sequence's replays its graphs)."""
        if self.weights is not None and len(runners) > 1:
            return forward_blocks(runners, blocks)
        return [runner.forward(*block) for runner, block in zip(runners, blocks)]

    def _head(self, lasts: list[torch.Tensor]) -> torch.Tensor:
        """The target head over every block's rows at once: [N, H] pre-norm -> logits [N, V]."""
        if self.weights is not None:
            return self.weights.head(lasts[0] if len(lasts) == 1 else torch.cat(lasts))
        return torch.cat([self.target.head(last) for last in lasts])

    def _settle(self, seq: Sequence, tree: Tree, aux: torch.Tensor, logits: torch.Tensor):
        """Verify ``seq``'s tree against its logits [n, V], keep the accepted path's cache, and take the new tokens;
        returns the draft's context entry of the accepted path when the draft drafted this round (``_extend`` gives
        it now), else keeps it for its next speculative round."""
        if seq.sampling.greedy:
            path, bonus = greedy_verify(tree, logits.argmax(-1).cpu())
        else:
            path, bonus = sampling_verify(tree, logits_to_probs(logits, seq.sampling).cpu(), seq.generator)
        P = seq.length
        seq.slot.runner.commit(path)
        accepted = [int(tree.tokens[i]) for i in path[1:]]
        entry = None
        if self.has_draft:
            entry = (aux[path], accepted + [bonus], P)  # the root and the accepted drafts, at P..
            if len(tree) == 1:
                seq.unseen.append(entry)
                entry = None
        for d in range(len(accepted)):
            seq.stats.position_accepts[d] += 1
        seq.stats.accept_lengths.append(len(path))
        seq.stats.verified_lengths.append(len(tree))
        seq.root = bonus
        self._take(seq, accepted + [bonus])
        return entry

    def _extend(self, seqs: list[Sequence], entries: list[tuple[torch.Tensor, list[int], int]]) -> None:
        """The drafted sequences' accepted states into their drafts' contexts: together where the drafts allow."""
        drafters = [seq.slot.drafter for seq in seqs]
        if can_batch(drafters):
            extend_together(drafters, entries)
        else:
            for drafter, entry in zip(drafters, entries):
                drafter.extend(*entry)

    def _take(self, seq: Sequence, new: list[int]) -> None:
        before = len(seq.produced)
        finish = take_tokens(seq.produced, new, seq.max_new_tokens, seq.stop_token_ids, seq.should_stop)
        seq.new = seq.produced[before:]
        seq.stats.new_tokens = len(seq.produced)
        seq.stats.total_seconds = time.perf_counter() - seq.started
        if finish is not None:
            seq.finish_reason = seq.stats.finish_reason = finish


def engine_schedule(decoder: SpecDecoder, schedule: ShapeSchedule | None) -> ShapeSchedule:
    """The schedule a decoder runs: ``schedule``, or without one its own shape at every batch size (plain without
    a draft). A schedule that speculates needs a draft."""
    has_draft = decoder.drafter is not None
    schedule = schedule or OneShape(decoder.spec if has_draft else None)
    if not has_draft and schedule.shapes:
        raise ValueError("a schedule that speculates needs a draft; serve with --draft, or without --schedule")
    return schedule


def _tree_mask(tree: Tree, P: int) -> torch.Tensor | None:
    """What a tree block's rows see: the committed P tokens and their ancestors [n, P+n]; None for one token."""
    if len(tree) == 1:
        return None
    mask = torch.ones(len(tree), P + len(tree), dtype=torch.bool)
    mask[:, P:] = tree.ancestor_mask()
    return mask
