"""Candidate aux layouts for the sweep: the ways a draft's states get miswired in practice."""

from __future__ import annotations

from eaglewire.core.contract import default_aux_boundaries


def candidate_layouts(declared: list[int], num_layers: int,
                      serving: dict[str, list[int]] | None = None) -> dict[tuple[int, ...], list[str]]:
    """layout -> reasons it is a candidate, in a stable order.

    - the declared layout and each serving reading (SGLang's per model file, vLLM's, defaults);
    - every boundary shifted by -1/+1 alone, and all together (an engine's off-by-one);
    - first-k and last-k of k+1 captured boundaries (the declared ones plus one more, e.g.
      the embedding output, the engine default or the final state): tools that capture one
      extra state and slice the wrong end feed a neighbouring layout without any error.
    """
    k = len(declared)
    out: dict[tuple[int, ...], list[str]] = {}

    def add(layout: list[int], why: str) -> None:
        if len(set(layout)) == len(layout) and all(0 <= b <= num_layers for b in layout):
            out.setdefault(tuple(layout), [])
            if why not in out[tuple(layout)]:
                out[tuple(layout)].append(why)

    add(declared, "declared")
    for label, layout in (serving or {}).items():
        add(layout, f"served by {label}")
    for i, b in enumerate(declared):
        for d in (-1, 1):
            add(declared[:i] + [b + d] + declared[i + 1:], f"boundary {b} -> {b + d}")
    for d in (-1, 1):
        add([b + d for b in declared], f"all {d:+d}")
    extras = {0, num_layers} | set(_default(num_layers))
    for layout in (serving or {}).values():
        extras |= set(layout)
    for e in sorted(extras - set(declared)):
        union = sorted(set(declared) | {e})
        for window, end in ((union[:k], "first"), (union[-k:], "last")):
            if window != declared:
                add(window, f"{end} {k} of {union}")
    return out


def _default(num_layers: int) -> list[int]:
    try:
        return default_aux_boundaries(num_layers)
    except ValueError:
        return []
