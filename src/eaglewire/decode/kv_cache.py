"""KV caches: keep the accepted path, drop rejected branches.

Shapes: B = 1 sequence, nKV key/value heads, S cached tokens, hd head dim, W a static cache's width,
N tokens of one verify/draft block, T tokens of one draft forward, H hidden.

The draft has two caches with one interface (``forward`` runs the draft over T new tokens and keeps their K/V,
``forward_top`` also gives each new token's best next tokens, ``commit`` / ``rollback`` end a round):
``DraftCache`` grows by concatenation (the CPU's: it attends over what is there and nothing more),
``StaticDraftCache`` holds a fixed width and replays a CUDA graph per T, the head's top-k inside (the GPU's: a
draft step is a few dozen small kernels, which launched one by one cost ten times their work).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eaglewire.decode.attention import attend
from eaglewire.decode.step_graphs import StepGraphs

MAX_GRAPH_TOKENS = 64  # a draft forward of at most this many tokens replays a graph (a longer one: the prompt)


def keep_rows(x: torch.Tensor, prefix: int, keep: torch.Tensor) -> torch.Tensor:
    """[B, n, S, hd] -> [B, n, prefix + len(keep), hd]: rows < prefix plus rows prefix + keep."""
    return torch.cat([x[:, :, :prefix], x[:, :, prefix + keep]], dim=2)


def widened(cache: torch.Tensor, dim: int, columns: int) -> torch.Tensor:
    """``cache`` with room for ``columns`` along ``dim``: itself when it has it, else a copy at least twice as wide
    (zeros past its old end), so a growing sequence copies it a logarithmic number of times. A copy moves it: a
    graph that reads the old buffer must be captured again (``widened(...) is not cache``)."""
    width = cache.shape[dim]
    if columns <= width:
        return cache
    shape = list(cache.shape)
    shape[dim] = max(columns, 2 * width) - width
    return torch.cat([cache, cache.new_zeros(shape)], dim=dim)


def compact_target_cache(cache, prefix: int, keep: list[int]) -> None:
    """Keep the first ``prefix`` entries and, of the block after them, the ``keep`` rows
    (the accepted path), in every layer of a transformers cache."""
    idx = torch.tensor(keep, dtype=torch.long)
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        idx_dev = idx.to(layer.keys.device)
        layer.keys = keep_rows(layer.keys, prefix, idx_dev)
        layer.values = keep_rows(layer.values, prefix, idx_dev)


def top_next(draft, prenorm: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft head's ``topk`` best next tokens after each state: prenorm [T, H] -> (log-probabilities [T, k]
    fp32, draft ids [T, k])."""
    return torch.log_softmax(draft.logits(prenorm).float(), dim=-1).topk(topk, dim=-1)


class DraftCache:
    """The draft's own KV cache: committed context plus a scratch tree while drafting."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # [1, nKV, S, hd]
        self.v: torch.Tensor | None = None
        self.committed = 0  # entries that came from target states (the context)

    def forward(self, draft, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """The draft over T new tokens after the cached ones, their K/V appended: emb/hidden [1, T, H]; positions
        [1, T]; mask [1, 1, T, S+T] bool (None: all cached entries and causal among the new) -> pre-norm [1, T, H]."""
        out, k, v = draft.forward_cached(emb, hidden, positions, self.k, self.v,
                                         None if mask is None else mask.to(emb.device))
        self.append(k, v)
        return out

    def forward_top(self, draft, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    mask: torch.Tensor | None, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward``, then each new token's ``topk`` best next tokens -> (pre-norm [1, T, H], log-probabilities
        [T, k], draft ids [T, k])."""
        out = self.forward(draft, emb, hidden, positions, mask)
        return (out, *top_next(draft, out[0], topk))

    def reserve(self, entries: int) -> None:
        """Nothing to reserve: this cache grows as it goes."""

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)

    def commit(self) -> None:
        self.committed = 0 if self.k is None else self.k.shape[2]

    def rollback(self) -> None:
        """Drop the scratch entries of the last drafting round."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :self.committed], self.v[:, :, :self.committed]

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]


def static_draft_forward(draft, k_cache: torch.Tensor, v_cache: torch.Tensor, emb: torch.Tensor, hidden: torch.Tensor,
                         positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor]:
    """The draft's decoding forward over a fixed-width cache: T new tokens written at ``slots`` [T], attending
    where ``mask`` [1, 1, T, W] allows -- shapes that depend on T alone. emb/hidden [1, T, H]; positions [1, T]
    -> (pre-norm [1, T, H],). The same layer math as ``Eagle3Draft.forward_cached``."""
    layer, attn = draft.midlayer, draft.midlayer.self_attn
    cos, sin = draft.rotary(positions, emb.dtype)
    q, k, v = attn.qkv(layer.attn_input(emb, hidden), cos, sin)  # [1, nH|nKV, T, hd]
    k_cache.index_copy_(2, slots, k)  # [1, nKV, W, hd]
    v_cache.index_copy_(2, slots, v)
    heads = attend(q, k_cache, v_cache, mask, attn.head_dim ** -0.5)  # [1, nH, T, hd]
    return (layer.finish(hidden, attn.out(heads)),)


def static_draft_level(draft, k_cache: torch.Tensor, v_cache: torch.Tensor, topk: int, **inputs: torch.Tensor
                       ) -> tuple[torch.Tensor, ...]:
    """``static_draft_forward``, then (``topk`` > 0) the head's ``topk`` best next tokens, in one graph:
    (pre-norm [1, T, H],) or (pre-norm [1, T, H], log-probabilities [T, k], draft ids [T, k])."""
    out, = static_draft_forward(draft, k_cache, v_cache, **inputs)
    return (out, *top_next(draft, out[0], topk)) if topk else (out,)


class StaticDraftCache:
    """The draft's KV cache at a fixed width W: context entries 0..committed-1, a round's scratch after them.

    Entry i sits at column i, as in ``DraftCache``, so a mask over DraftCache's columns is one over these (the
    columns past it are masked). Columns past ``length`` may hold a rolled-back round's K/V: never unmasked
    before they are written again. On CUDA each T replays its captured graph (``graphs``); elsewhere (tests)
    the same forward runs eagerly."""

    def __init__(self, draft, width: int, device: torch.device, dtype: torch.dtype, *, graphs: bool | None = None) -> None:
        attn = draft.midlayer.self_attn
        self.draft = draft
        self.k = torch.zeros(1, attn.num_kv_heads, width, attn.head_dim, dtype=dtype, device=device)  # [1, nKV, W, hd]
        self.v = torch.zeros_like(self.k)
        self.length = 0
        self.committed = 0
        self.use_graphs = device.type == "cuda" if graphs is None else graphs
        self.graphs: dict[str, StepGraphs] = {}  # a step's name -> its graph per number of new entries (``replay``)

    def reset(self) -> None:
        """Forget every entry: a new sequence (the width and the captured graphs stay)."""
        self.length = self.committed = 0

    def reserve(self, entries: int) -> None:
        """Room for ``entries`` columns (a growth moves the cache: its graphs are captured again)."""
        k = widened(self.k, 2, entries)  # [1, nKV, W', hd]
        if k is not self.k:
            self.k, self.v = k, widened(self.v, 2, entries)
            self.graphs.clear()  # they read the old buffers

    def forward(self, draft, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """As ``DraftCache.forward``: emb/hidden [1, T, H]; positions [1, T]; mask [1, 1, T, S+T] bool or None
        (causal) -> pre-norm [1, T, H]."""
        return self._run(0, self._inputs(draft, emb, hidden, positions, mask))[0]

    def forward_top(self, draft, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    mask: torch.Tensor | None, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``DraftCache.forward_top``; on CUDA the head's log-softmax and top-k replay in the step's graph."""
        return self._run(topk, self._inputs(draft, emb, hidden, positions, mask))

    def _run(self, topk: int, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The step over ``inputs``, replayed from its graph on CUDA (one per T up to MAX_GRAPH_TOKENS)."""
        T = inputs["emb"].shape[1]
        step = lambda **x: static_draft_level(self.draft, self.k, self.v, topk, **x)  # noqa: E731
        return self.replay(f"level top-{topk}", T, step, inputs) if T <= MAX_GRAPH_TOKENS else step(**inputs)

    def replay(self, name: str, tokens: int, fn: Callable[..., tuple[torch.Tensor, ...]],
               inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``fn(**inputs)``, a step over this cache's buffers (read as ``self.k`` / ``self.v`` when it runs) that
        writes ``tokens`` new entries: on CUDA replayed from the graph captured for (``name``, ``tokens``) --
        ``fn`` is the one given with ``name`` first -- elsewhere, or where a capture fails, eagerly. The outputs
        are copies (a replay overwrites its buffers); a widened cache captures its graphs again."""
        if self.use_graphs:
            if name not in self.graphs:
                self.graphs[name] = StepGraphs(fn, f"the draft's {name} step")
            replayed = self.graphs[name].copies(tokens, **inputs)
            if replayed is not None:
                return replayed
            self.use_graphs = False
        return fn(**inputs)

    def _inputs(self, draft, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """A step's graph inputs, built on the cache's device (no host copy, so no wait for the device): the T new
        tokens go to columns S..S+T-1, the mask is widened to the cache's W columns."""
        assert draft is self.draft, "a static draft cache runs the draft it was made for"
        T, S = emb.shape[1], self.length
        self.reserve(S + T)
        W, dev = self.k.shape[2], self.k.device
        full = torch.zeros(1, 1, T, W, dtype=torch.bool, device=dev)  # [1, 1, T, W]
        if mask is None:
            full[..., :S] = True
            full[0, 0, :, S:S + T] = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        else:
            full[..., :S + T] = mask.to(dev)
        self.length = S + T
        return dict(emb=emb, hidden=hidden, positions=positions.to(dev), slots=torch.arange(S, S + T, device=dev),
                    mask=full)

    def commit(self) -> None:
        self.committed = self.length

    def rollback(self) -> None:
        """Drop the scratch entries of the last drafting round (their columns are masked until rewritten)."""
        self.length = self.committed
