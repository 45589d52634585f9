"""Sampled decoding against the target's exact distribution: two tokens after a fixed prompt, whose
V x V outcomes have known probabilities, judged by a chi-square test with the rare cells pooled."""

from __future__ import annotations

import torch

from eaglewire.decode.sampling import SamplingParams, logits_to_probs


def two_token_probs(target, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[V*V] the target's probability of each (first, second) pair sampled after ``prompt``."""
    V = target.model.config.vocab_size
    with torch.no_grad():
        p1 = logits_to_probs(target.model(torch.tensor([prompt])).logits[0, -1:], params)[0]  # [V]
        seconds = torch.tensor([prompt + [a] for a in range(V)])  # [V, len + 1]
        p2 = logits_to_probs(target.model(seconds).logits[:, -1], params)  # [V, V]
    return (p1[:, None] * p2).flatten()


def assert_matches(counts: torch.Tensor, exact: torch.Tensor) -> None:
    """``counts`` [V*V] of n draws agree with ``exact`` (chi-square at ~p 0.001 for this many dof)."""
    expected = counts.sum() * exact
    keep = expected >= 5  # pool rare cells, as a chi-square test requires
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expect = torch.cat([expected[keep], expected[~keep].sum()[None]])
    chi2 = float(((observed - expect) ** 2 / expect.clamp(min=1e-9)).sum())
    dof = int(keep.sum())  # cells - 1, the pooled cell included
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (chi2, dof)
