"""One batched decode step over fixed buffers, run eagerly or replayed as one CUDA graph.

Shapes: B rows, S cache columns (a bucket of at least T + max_new_tokens - 1), T the prompt
width, H hidden, V vocabulary, L layers, nH / nKV query / key-value heads, hd head dim, n steps.

Why: a batch-32 step of an 8B target reads its weights once (~4 ms on an H200 at the memory
roofline); launched op by op from Python, with a host sync per step, it costs many times that.
A CUDA graph replays the same kernels on the same memory, so everything that changes from step
to step lives in device buffers that the step itself reads and advances:

- ``token`` [B]: this step's input tokens, fed at cache column ``col`` of every row;
- ``col`` [1]: that column, advanced by one at the end of the step;
- ``pad`` [B]: padding columns before each row's prompt (set per call); position = col - pad;
- the cache [L, B, nKV, S, hd], written with ``index_copy_`` at ``col``; attention reads all S
  columns under the key mask pad <= column <= col (one ``attend`` per layer, no row groups);
- ``tokens`` [S + 1, B]: the tokens fed at each column, the picked ones landing at col + 1
  (column-major, so the columns read back are one contiguous block).

The layout is ``batched.BatchedDecoder``'s (left-padded prompts, new tokens from column T), so
its prefill fills this cache. Rows that stopped keep running and are cut on the host: the step
is weight-bound, so a finished row costs almost nothing and no row ever moves. A greedy pick
(argmax) is part of the step, and so of the graph; a sampled pick runs eagerly after it.
The same step runs eagerly (on CPU, or on CUDA when asked): tests compare it with the grouped
path there, and the graph with the eager step on a GPU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from eaglewire.decode.attention import attend_biased, attention_bias
from eaglewire.decode.runner import LeanWeights, rope
from eaglewire.decode.step_graphs import capture

COLUMN_BUCKET = 256  # cache widths are rounded up to this, so calls of similar length reuse one graph
WARMUP_STEPS = 3  # eager steps on a side stream before capture (PyTorch's CUDA graphs docs)
READBACK_EVERY = 8  # graph steps queued per token read-back; one such chunk stays queued ahead

Pick = Callable[[torch.Tensor], torch.Tensor]  # logits [B, V] -> tokens [B]


def cache_columns(needed: int, bucket: int = COLUMN_BUCKET) -> int:
    """``needed`` cache columns rounded up to a multiple of ``bucket``."""
    return -(-needed // bucket) * bucket


def key_mask(pad: torch.Tensor, col: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """pad [B], col [1], columns [S] (0..S-1) -> [B, 1, 1, S] bool: the keys row b sees at
    column ``col``, its prompt and new tokens so far (pad[b] <= column <= col)."""
    return ((columns >= pad[:, None]) & (columns <= col))[:, None, None]  # [B, 1, 1, S]


def split_rows(tokens: torch.Tensor, stop_ids: torch.Tensor) -> list[tuple[list[int], bool]]:
    """tokens [B, n] (each row's new tokens, in order) -> per row (the tokens before its first
    stop token, whether a stop token came)."""
    stopped = torch.isin(tokens, stop_ids)  # [B, n]
    out = []
    for row, hits in zip(tokens.tolist(), stopped.tolist()):
        cut = hits.index(True) if True in hits else len(row)
        out.append((row[:cut], cut < len(row)))
    return out


class StaticStep:
    """A decode step of B rows over an S-column cache, its buffers fixed for its lifetime."""

    def __init__(self, w: LeanWeights, rows: int, columns: int, *, greedy: bool, graph: bool = False) -> None:
        """``graph``: the step will be captured (``capture``): tokens come back through pinned
        memory, a few steps at a time, without stopping the launches."""
        dev, long = w.device, torch.long
        self.w, self.rows, self.columns, self.greedy = w, rows, columns, greedy
        # zeros: masked columns are still read (as 0 * value), so they must never hold NaN
        self.k = torch.zeros(len(w.layers), rows, w.nKV, columns, w.hd, dtype=w.dtype, device=dev)  # [L, B, nKV, S, hd]
        self.v = torch.zeros_like(self.k)
        self.token = torch.zeros(rows, dtype=long, device=dev)  # [B]
        self.pad = torch.zeros(rows, dtype=long, device=dev)  # [B]
        self.col = torch.zeros(1, dtype=long, device=dev)  # [1]
        self.column_ids = torch.arange(columns, device=dev)  # [S]
        self.tokens = torch.zeros(columns + 1, rows, dtype=long, device=dev)  # [S+1, B]
        self.host = torch.zeros(columns + 1, rows, dtype=long, pin_memory=graph)  # [S+1, B] read-back
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [B, V] the graph's output

    def fits(self, rows: int, columns: int, greedy: bool) -> bool:
        return (rows, columns, greedy) == (self.rows, self.columns, self.greedy)

    def start(self, first: torch.Tensor, pad: torch.Tensor, width: int) -> None:
        """A new call whose prompts (prefilled into ``k``/``v``) are padded by pad [B] to
        ``width`` columns and whose first new tokens first [B] are fed at column ``width``.
        Waits for those tokens on the host (the prefill's end)."""
        self.pad.copy_(pad)
        self.token.copy_(first)
        self.col.fill_(width)
        self.tokens[width] = first
        self.host[width] = first.cpu()

    def forward(self) -> torch.Tensor:
        """Feed ``token`` at column ``col`` -> next-token logits [B, V]; writes the cache column."""
        w, B = self.w, self.rows
        h = w.embed(self.token)  # [B, H]
        cos, signed_sin = rope(w.rotary, h, self.col - self.pad)  # [B, 1, hd]
        bias = attention_bias(key_mask(self.pad, self.col, self.column_ids), w.nH // w.nKV, w.dtype)  # [B, 1, G, S]
        for i, layer in enumerate(w.layers):
            q, k, v = layer.qkv(h, cos, signed_sin, w.nH, w.nKV, w.hd)  # q [nH, B, hd], k/v [nKV, B, hd]
            self.k[i].index_copy_(2, self.col, k.transpose(0, 1)[:, :, None])  # [B, nKV, 1, hd] at col
            self.v[i].index_copy_(2, self.col, v.transpose(0, 1)[:, :, None])
            q = q.transpose(0, 1)[:, :, None]  # [B, nH, 1, hd]
            attn = attend_biased(q, self.k[i], self.v[i], bias, w.scale)  # [B, nH, 1, hd]
            h = layer.out_mlp(h, attn.reshape(B, w.nH * w.hd))  # [B, H]
        return w.head(h)  # [B, V]

    def advance(self, picked: torch.Tensor) -> None:
        """picked [B]: the next tokens; they are fed next, at column col + 1."""
        self.token.copy_(picked)
        self.tokens.index_copy_(0, self.col + 1, picked[None])  # [1, B] at col + 1
        self.col.add_(1)

    def _body(self) -> torch.Tensor:
        """What one step runs on the device (and what the graph records) -> logits [B, V]."""
        logits = self.forward()
        if self.greedy:
            self.advance(logits.argmax(-1))
        return logits

    def capture(self, pool) -> None:
        """Record ``_body`` as one CUDA graph in ``pool``, after a warm-up on a side stream. The
        warm-up runs real steps from column 0 on zeros: the columns and tokens it writes are
        prefilled, masked or overwritten before any call reads them."""
        self.graph, self.logits = capture(self._body, pool, warmup=WARMUP_STEPS, device=self.k.device)

    def run(self, pick: Pick) -> None:
        """One step: the graph's replay where captured, else the same ops eagerly; a sampled
        step then picks from its logits with ``pick``."""
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        else:
            logits = self._body()
        if not self.greedy:
            self.advance(pick(logits))

    def read_back(self, start: int, end: int) -> torch.cuda.Event | None:
        """Copy columns start..end-1 of ``tokens`` to ``host``; with a graph asynchronously,
        returning the event that marks the copy done."""
        if self.graph is None:
            self.host[start:end] = self.tokens[start:end].cpu()
            return None
        self.host[start:end].copy_(self.tokens[start:end], non_blocking=True)  # pinned, contiguous: async
        event = torch.cuda.Event()
        event.record()
        return event


def decode(step: StaticStep, width: int, max_steps: int, stop_ids: torch.Tensor, pick: Pick) -> int:
    """Run up to ``max_steps`` steps from column ``width`` (after ``start``) until every row has a
    stop token; the tokens land in ``step.host`` [S+1, B] from column ``width``. Returns the steps run.

    With a graph, READBACK_EVERY steps are queued per read-back and one chunk's tokens are checked
    while the next chunk runs, so the device never waits on the host; it may run a chunk or two
    past the last stop. Eagerly, the tokens are checked after every step.
    """
    live = ~torch.isin(step.host[width], stop_ids)  # [B]
    every = READBACK_EVERY if step.graph is not None else 1
    pending: deque[tuple[torch.cuda.Event | None, int, int]] = deque()  # (copy done, first column, end)
    done = 0
    try:
        while done < max_steps and live.any():
            n = min(every, max_steps - done)
            for _ in range(n):
                step.run(pick)
            first = width + 1 + done
            done += n
            pending.append((step.read_back(first, first + n), first, first + n))
            while pending and (len(pending) > 1 or pending[0][0] is None):  # keep one chunk in flight
                live &= ~_stopped_in(step, stop_ids, *pending.popleft())
    finally:
        while pending:  # the host buffer is reused: no copy may still be landing after we return
            _stopped_in(step, stop_ids, *pending.popleft())
    return done


def _stopped_in(step: StaticStep, stop_ids: torch.Tensor, event: torch.cuda.Event | None, start: int,
                end: int) -> torch.Tensor:
    """Wait for a read-back; whether each row picked a stop token in its columns [B]."""
    if event is not None:
        event.synchronize()
    return torch.isin(step.host[start:end], stop_ids).any(dim=0)  # [B]
