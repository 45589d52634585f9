"""Batched plain decoding (greedy or sampled) for Llama-family targets: the regeneration workload.

Shapes: B rows in flight, T prompt width (the longest prompt), S cache columns
(T + max_new_tokens - 1), N prompt tokens packed into one prefill chunk, n tokens of one
piece of a prompt, m keys, H hidden, V vocabulary, L layers, nH / nKV query / key-value heads,
G = nH / nKV query heads per key-value head, hd head dim.

Layout: prompts are left padded in the cache [L, B, nKV, S, hd]: row b's prompt fills columns
pad[b]..T-1 and its k-th new token goes to column T + k, the same column in every row, so a
decode step writes one column; positions start at 0 at each prompt's first real token and a
mask hides the padding. The prefill packs the prompts' real tokens (no padding) into chunks of
at most ``prefill_tokens``: one GEMM per weight matrix over a chunk, attention per piece (a
prompt, or the part of a long prompt that fits the chunk), logits only for each prompt's last
token. A decode step is one GEMM over the B rows per weight matrix; rows are sorted longest
prompt first, and attention runs per group of rows of similar padding, each from its own first
prompt column, so short prompts in a batch with a long one do not read its padding. Rows that
stopped are dropped from the batch (moved out of the cache in place) once that saves more than
it costs.

Three ways to run the decode steps (``mode``): ``grouped``, the above, eager (the CPU default);
``graph`` (the CUDA default), one CUDA graph per batch shape (``static_step.StaticStep``: fixed
buffers, attention over the whole cache width under a key mask, rows that stopped running on,
tokens read back a few steps at a time); ``static``, that same step run eagerly, to test it
anywhere. If capture fails, one warning and the grouped path.

The layers' math and weights are runner.py's (``LeanWeights``: fused, packed); this module only
batches them. Replies follow ``regenerate.split_reply``: the tokens before the first stop token,
and whether a stop token came (the stop token itself is not returned).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from eaglewire.decode.attention import attend
from eaglewire.decode.runner import LeanWeights, rope
from eaglewire.decode.sampling import SamplingParams, logits_to_probs, sample
from eaglewire.decode.static_step import StaticStep, cache_columns, decode, split_rows
from eaglewire.model.target import Target

log = logging.getLogger(__name__)
MODES = ("auto", "grouped", "static", "graph")

Piece = tuple[int, int, int]  # (row, start, end): prompt tokens start..end-1 of one row


@dataclass
class BatchStats:
    """What the last ``generate`` call did."""

    prompts: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0  # stop tokens included, like regenerate's report
    steps: int = 0  # decode steps after the prefill
    compactions: int = 0  # times finished rows were dropped from the batch
    mode: str = ""  # the path that ran: grouped, static or graph
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.total_seconds, 1e-9)


class BatchedDecoder:
    """Batched greedy/sampled decoding with a lean forward; weights prepared once, reused per call."""

    def __init__(self, target: Target, *, prefill_tokens: int = 2048, mode: str = "auto") -> None:
        """``mode``: auto (graph on CUDA, grouped elsewhere), grouped, static or graph (see the module)."""
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        self.w = LeanWeights(target)
        self.prefill_tokens = prefill_tokens
        self.mode = resolve_mode(mode, self.w.device)
        self.stats = BatchStats()
        self._static: StaticStep | None = None  # the last batch shape's step (and graph), reused while it fits
        self._pool = None  # the one CUDA graph memory pool of this decoder's graphs

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 stop_token_ids: Iterable[int], sampling: SamplingParams | None = None,
                 seed: int = 0) -> list[tuple[list[int], bool]]:
        """Per prompt: (new tokens before the first stop token, whether a stop token came).

        Greedy unless ``sampling`` says otherwise; sampling draws from a generator seeded with
        ``seed`` (``sampling.seed`` is not read), so the same call gives the same replies.
        """
        _check_request(prompts, max_new_tokens)
        w = self.w
        sampling = sampling or SamplingParams()
        stops = set(stop_token_ids)
        gen = torch.Generator(device=w.device)
        gen.manual_seed(seed)
        start = time.perf_counter()
        self.stats = stats = BatchStats(prompts=len(prompts), prompt_tokens=sum(map(len, prompts)))
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # longest first
        if self.mode != "grouped":
            step = self._static_step(len(prompts), len(prompts[order[0]]) + max_new_tokens - 1, sampling.greedy)
            if step is not None:
                return self._generate_static(step, prompts, order, max_new_tokens, stops, sampling, gen, start)
        stats.mode = "grouped"
        batch = _Batch.allocate(order, [len(prompts[i]) for i in order], max_new_tokens,
                                len(w.layers), w.nKV, w.hd, w.dtype, w.device)
        logits = self._prefill([prompts[i] for i in order], batch)  # [B, V]
        token = self._pick(logits, sampling, gen)  # [B]
        stats.prefill_seconds = time.perf_counter() - start
        replies: list[list[int]] = [[] for _ in prompts]
        stopped = [False] * len(prompts)
        for step in range(max_new_tokens):
            for r, t in enumerate(token.tolist()):
                if not batch.live[r]:
                    continue
                stats.new_tokens += 1
                if t in stops:
                    stopped[batch.rows[r]], batch.live[r] = True, False
                else:
                    replies[batch.rows[r]].append(t)
            col, steps_left = batch.width + step, max_new_tokens - 1 - step  # col: this step's column
            if steps_left == 0 or not any(batch.live):
                break
            if _should_compact(batch.live.count(False), batch.live.count(True), steps_left):
                token = token[batch.compact(col)]
                stats.compactions += 1
            token = self._pick(self._step(token, col, batch), sampling, gen)
            stats.steps += 1
        stats.total_seconds = time.perf_counter() - start
        return list(zip(replies, stopped))

    def _generate_static(self, step: StaticStep, prompts: Sequence[Sequence[int]], order: list[int],
                         max_new_tokens: int, stops: set[int], sampling: SamplingParams, gen: torch.Generator,
                         start: float) -> list[tuple[list[int], bool]]:
        """``generate`` with ``step``: the prefill fills its cache, then fixed-shape steps."""
        stats, lengths = self.stats, [len(prompts[i]) for i in order]
        T = lengths[0]
        batch = _Batch(k=step.k, v=step.v, pads=[T - n for n in lengths], width=T, rows=order,
                       live=[True] * len(order))
        first = self._pick(self._prefill([prompts[i] for i in order], batch), sampling, gen)  # [B]
        step.start(first, batch.pad, T)
        stats.prefill_seconds = time.perf_counter() - start
        stop_ids = torch.tensor(sorted(stops), dtype=torch.long)
        stats.steps = decode(step, T, max_new_tokens - 1, stop_ids,
                             lambda logits: self._pick(logits, sampling, gen))
        rows = split_rows(step.host[T:T + 1 + stats.steps].T, stop_ids)  # per row, in batch order
        replies: list[tuple[list[int], bool]] = [([], False)] * len(prompts)
        for prompt, reply in zip(order, rows):
            replies[prompt] = reply
        stats.new_tokens = sum(len(tokens) + stopped for tokens, stopped in rows)
        stats.mode = "graph" if step.graph is not None else "static"
        stats.total_seconds = time.perf_counter() - start
        return replies

    def _static_step(self, rows: int, needed: int, greedy: bool) -> StaticStep | None:
        """The step for ``rows`` rows and ``needed`` cache columns: the last one where it fits,
        else a new one (captured in graph mode). None, and the grouped path from then on, when
        capture fails."""
        columns = cache_columns(needed)
        if self._static is not None and self._static.fits(rows, columns, greedy):
            return self._static
        self._static = None  # free the old cache and graph before allocating the new
        if self.mode == "static":
            self._static = StaticStep(self.w, rows, columns, greedy=greedy)
            return self._static
        try:
            step = StaticStep(self.w, rows, columns, greedy=greedy, graph=True)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            step.capture(self._pool)
        except Exception as exc:  # any op can refuse capture; the grouped path needs none
            log.warning("CUDA graph capture failed (%s: %s); batched decoding runs the grouped eager path",
                        type(exc).__name__, exc)
            self.mode = "grouped"
            return None
        self._static = step
        return step

    # -- the forward -------------------------------------------------------

    def _prefill(self, prompts: Sequence[Sequence[int]], batch: _Batch) -> torch.Tensor:
        """Write every prompt's K/V into the cache; return the logits of each prompt's last token [B, V]."""
        w = self.w
        dev, pad, k_cache, v_cache = w.device, batch.pads, batch.k, batch.v
        last = torch.empty(len(prompts), w.hidden, dtype=w.dtype, device=dev)  # [B, H]
        for chunk in prefill_chunks([len(p) for p in prompts], self.prefill_tokens):
            ids = torch.tensor([t for r, s, e in chunk for t in prompts[r][s:e]], device=dev)  # [N]
            positions = torch.cat([torch.arange(s, e, device=dev) for _, s, e in chunk])  # [N]
            masks = [torch.ones(e - s, e, dtype=torch.bool, device=dev).tril(s)[None]  # [1, n, e]
                     for _, s, e in chunk]
            h = w.embed(ids)  # [N, H]
            cos, signed_sin = rope(w.rotary, h, positions)  # [N, 1, hd]
            for i, layer in enumerate(w.layers):
                q, k, v = layer.qkv(h, cos, signed_sin, w.nH, w.nKV, w.hd)  # [nH|nKV, N, hd]
                outs, o = [], 0
                for (r, s, e), mask in zip(chunk, masks):
                    n, c = e - s, pad[r]  # c: the row's first prompt column
                    k_cache[i, r, :, c + s:c + e] = k[:, o:o + n]
                    v_cache[i, r, :, c + s:c + e] = v[:, o:o + n]
                    attn = attend(q[:, o:o + n], k_cache[i, r, :, c:c + e], v_cache[i, r, :, c:c + e],
                                   mask, w.scale)  # [nH, n, hd]
                    outs.append(attn.transpose(0, 1).reshape(n, w.nH * w.hd))  # [n, nH*hd]
                    o += n
                h = layer.out_mlp(h, torch.cat(outs))  # [N, H]
            for o, (r, s, e) in zip(_offsets(chunk), chunk):
                if e == len(prompts[r]):  # the prompt's last token: its logits pick the first new token
                    last[r] = h[o + e - s - 1]
        return w.head(last)

    def _step(self, token: torch.Tensor, col: int, batch: _Batch) -> torch.Tensor:
        """token [B], written at cache column ``col`` of every row -> next-token logits [B, V]."""
        w = self.w
        B = token.shape[0]
        h = w.embed(token)  # [B, H]
        cos, signed_sin = rope(w.rotary, h, col - batch.pad)  # [B, 1, hd]; position = column - padding
        mask = (torch.arange(col + 1, device=w.device) >= batch.pad[:, None])[:, None, None]  # [B, 1, 1, col+1]
        for i, layer in enumerate(w.layers):
            q, k, v = layer.qkv(h, cos, signed_sin, w.nH, w.nKV, w.hd)  # q [nH, B, hd], k/v [nKV, B, hd]
            batch.k[i, :, :, col] = k.transpose(0, 1)  # [B, nKV, hd]
            batch.v[i, :, :, col] = v.transpose(0, 1)
            q = q.transpose(0, 1)[:, :, None]  # [B, nH, 1, hd]
            attn = torch.cat([  # per group of rows, from the group's first prompt column
                attend(q[a:b], batch.k[i, a:b, :, c:col + 1], batch.v[i, a:b, :, c:col + 1],
                        None if batch.pads[b - 1] == c else mask[a:b, ..., c:], w.scale)
                for a, b, c in batch.groups])  # [B, nH, 1, hd]
            h = layer.out_mlp(h, attn.reshape(B, w.nH * w.hd))  # [B, H]
        return w.head(h)

    @staticmethod
    def _pick(logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator) -> torch.Tensor:
        """[B, V] logits -> [B] next tokens."""
        if sampling.greedy:
            return logits.argmax(-1)
        return sample(logits_to_probs(logits, sampling), gen)


@dataclass
class _Batch:
    """The rows in flight, in batch order (longest prompt first, so padding ascends)."""

    k: torch.Tensor  # [L, B, nKV, S, hd]
    v: torch.Tensor  # [L, B, nKV, S, hd]
    pads: list[int]  # [B] padding columns before each row's prompt
    width: int  # T: the first column of the new tokens
    rows: list[int]  # [B] the prompt of each row
    live: list[bool]  # [B] no stop token yet
    pad: torch.Tensor = field(init=False)  # [B] pads on the cache's device
    groups: list[tuple[int, int, int]] = field(init=False)  # (first row, end row, first column read)

    @classmethod
    def allocate(cls, rows: list[int], lengths: list[int], max_new_tokens: int, L: int, nKV: int,
                 hd: int, dtype: torch.dtype, device: torch.device) -> _Batch:
        """Rows with prompts of ``lengths`` (descending), S = T + max_new_tokens - 1 cache columns
        (the last new token is never fed). Only the padding is zeroed: it is masked but read, so it
        must not be NaN; every other column is written before it is read."""
        T = max(lengths)
        pads = [T - n for n in lengths]
        k = torch.empty(L, len(lengths), nKV, T + max_new_tokens - 1, hd, dtype=dtype, device=device)
        v = torch.empty_like(k)
        for r, pad in enumerate(pads):
            k[:, r, :, :pad] = 0
            v[:, r, :, :pad] = 0
        return cls(k=k, v=v, pads=pads, width=T, rows=rows, live=[True] * len(lengths))

    def __post_init__(self) -> None:
        self._regroup()

    def _regroup(self) -> None:
        self.pad = torch.tensor(self.pads, device=self.k.device)  # [B]
        self.groups = [(a, b, self.pads[a]) for a, b in attention_groups(self.pads)]

    def compact(self, col: int) -> torch.Tensor:
        """Drop the finished rows; return the kept rows' old indices [B'].

        In place, row by row, the cache's first ``col`` columns only (the rest is unwritten):
        kept rows keep their order, so a row only ever moves to a lower, already free, index.
        """
        keep = [r for r, alive in enumerate(self.live) if alive]
        for new, old in enumerate(keep):
            if new != old:
                self.k[:, new, :, :col] = self.k[:, old, :, :col]  # [L, nKV, col, hd]
                self.v[:, new, :, :col] = self.v[:, old, :, :col]
        self.k, self.v = self.k[:, :len(keep)], self.v[:, :len(keep)]  # [L, B', nKV, S, hd]
        self.pads, self.rows = [self.pads[r] for r in keep], [self.rows[r] for r in keep]
        self.live = [True] * len(keep)
        self._regroup()
        return torch.tensor(keep, device=self.k.device)


def resolve_mode(mode: str, device: torch.device) -> str:
    """``auto`` -> graph on a CUDA device (where torch has CUDA), grouped elsewhere; the others
    as asked, graph only on CUDA."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    cuda = device.type == "cuda" and torch.cuda.is_available()
    if mode == "auto":
        return "graph" if cuda else "grouped"
    if mode == "graph" and not cuda:
        raise ValueError(f"mode 'graph' captures CUDA graphs; this target is on {device}: use 'static' to run "
                         "the same step eagerly, or 'grouped'")
    return mode


def generate_batch(target: Target, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                   stop_token_ids: Iterable[int], sampling: SamplingParams | None = None,
                   seed: int = 0) -> list[tuple[list[int], bool]]:
    """One-shot ``BatchedDecoder(target).generate(...)``; keep a BatchedDecoder to reuse its weights."""
    return BatchedDecoder(target).generate(prompts, max_new_tokens=max_new_tokens,
                                           stop_token_ids=stop_token_ids, sampling=sampling, seed=seed)


# -- small pure pieces -------------------------------------------------------

def _check_request(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    if not prompts:
        raise ValueError("no prompts; give at least one")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt is empty; give at least one token per prompt")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


def prefill_chunks(lengths: Sequence[int], budget: int) -> list[list[Piece]]:
    """Split prompts of ``lengths`` into chunks of at most ``budget`` tokens, in order.

    A chunk is a list of pieces (row, start, end); a prompt longer than what is left of a
    chunk continues in the next one, so every piece's earlier tokens are already cached.
    """
    chunks, chunk, room = [], [], budget
    for row, n in enumerate(lengths):
        start = 0
        while start < n:
            end = start + min(n - start, room)
            chunk.append((row, start, end))
            room -= end - start
            start = end
            if room == 0:
                chunks.append(chunk)
                chunk, room = [], budget
    if chunk:
        chunks.append(chunk)
    return chunks


def _offsets(chunk: list[Piece]) -> list[int]:
    """Where each piece starts in the chunk's packed tokens."""
    out, o = [], 0
    for _, s, e in chunk:
        out.append(o)
        o += e - s
    return out


def _should_compact(dead: int, live: int, steps_left: int) -> bool:
    """Drop finished rows when the row-steps saved outweigh moving the live rows' cache (at
    worst all of them; moving one row's cache costs about one row-step: both stream that much
    memory)."""
    return dead > 0 and dead * steps_left >= live


def attention_groups(pads: Sequence[int], split_cost: int = 256) -> list[tuple[int, int]]:
    """Split rows of ascending padding into contiguous groups [a, b) that each attend from their
    first row's first prompt column: the fewest wasted reads of padding, counted in (row, column)
    pairs, plus ``split_cost`` per group (one more attention call per layer costs about as much
    as reading a few hundred more row-columns of K/V). Dynamic programming over the cut points."""
    B = len(pads)
    prefix = [0]
    for p in pads:
        prefix.append(prefix[-1] + p)
    best, cut = [0] + [float("inf")] * B, [0] * (B + 1)  # best[b]: rows :b grouped; cut[b]: last group's start
    for b in range(1, B + 1):
        for a in range(b):
            waste = prefix[b] - prefix[a] - (b - a) * pads[a]  # padding columns read by rows a:b
            if best[a] + waste + split_cost < best[b]:
                best[b], cut[b] = best[a] + waste + split_cost, a
    groups, b = [], B
    while b > 0:
        groups.append((cut[b], b))
        b = cut[b]
    return groups[::-1]
