"""States captured through a serving engine (``prepare --capture ENGINE``), checked against eaglewire's own.

An engine's "layer id i" and "the last layer" are its own convention, and engines have been wrong about it
(an off-by-one last slot, a post-norm last state). So the first sequences of every capture run are captured
both ways, and each of the engine's states is compared with the in-process state of *every* boundary: a state
that is not its own boundary's within the dtype's tolerance stops the run, naming the boundary it matches
instead, if any.

Shapes: T tokens, n captured slots, k aux boundaries, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglewire.model.boundary_capture import capture
from eaglewire.model.target import Target

# Relative error (``relative_error``: per token, averaged) within which an engine's state is the same state. fp32:
# the engines' kernels sum in another order; bf16: each layer's output is rounded to 2^-8 relative, and the rounding
# compounds over layers (vLLM 0.32.0 against eaglewire, both bf16, SmolLM2-135M: 0.005 at boundary 2, 0.015 at 15,
# 0.03 at 27, up to 0.05 at the label state 30, bf16 storage included). Neighbouring boundaries of SmolLM2 are
# 0.24 to 0.9 apart per token, so a state one layer off is 2.4x the bf16 tolerance away.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-1, torch.float16: 2e-2}
PRE_NORM, POST_NORM = "pre-norm", "post-norm"  # which side of the final norm an engine's label slot is on
CHECKED_SEQUENCES = 4  # sequences captured both ways on every run


class EngineCaptureError(RuntimeError):
    """The engine's states are not the boundaries they are said to be: nothing is written from them."""


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The mean over tokens of ||a_t - b_t|| / ||b_t|| ([T, H] each). Not one norm over [T, H]: that is the first
    token's, whose state is an attention sink (SmolLM2's after layer 11: 25,000 at token 0, ~150 elsewhere), and
    under it boundaries 12 to 27 are 1-4% apart, inside bf16's tolerance: an off-by-one would pass."""
    a, b = a.float(), b.float().to(a.device)  # an engine's states are read to the host; ours may be on a GPU
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)).mean())


def states_here(target: Target, token_ids: list[int]) -> dict[int, torch.Tensor]:
    """Every boundary 0..L of ``token_ids`` in process: {boundary: [T, H]} (L before the final norm)."""
    L = target.num_layers
    out = capture(target, torch.tensor([token_ids]), list(range(L)))
    H = out.last_hidden.shape[-1]
    every = out.aux_hidden[0].reshape(len(token_ids), L, H)  # [T, L*H] -> [T, L, H]
    return {b: every[:, b] for b in range(L)} | {L: out.last_hidden[0]}


@dataclass(frozen=True)
class SlotCheck:
    boundary: int  # what the engine says the slot holds
    own: float  # its relative error against that boundary here
    closest: int  # the boundary here it is closest to
    closest_error: float

    def ok(self, tolerance: float) -> bool:
        """Its own boundary within ``tolerance``, and no other boundary closer."""
        return self.own <= tolerance and self.closest == self.boundary


def normed(target: Target, state: torch.Tensor) -> torch.Tensor:
    """[T, H] the target's final norm applied to ``state`` (an engine that returns its label state after the norm
    is compared with ours normed alike)."""
    with torch.no_grad():
        return target.decoder.norm(state.to(device=target.device, dtype=target.dtype)).float()


def check_slots(engine: torch.Tensor, slots: list[int], here: dict[int, torch.Tensor], *,
                here_label: dict[int, torch.Tensor] | None = None, label: int | None = None) -> list[SlotCheck]:
    """Each engine slot ([T, n, H], slot j said to hold boundary ``slots[j]``) against every boundary here; the
    slot of boundary ``label`` against ``here_label`` instead where given (every boundary after the final norm)."""
    out = []
    engine = engine.to(next(iter(here.values())).device)  # [T, n, H], beside the states it is compared with
    for j, b in enumerate(slots):
        against = here_label if here_label is not None and b == label else here
        errors = {k: relative_error(engine[:, j], state) for k, state in against.items()}
        closest = min(errors, key=errors.get)
        out.append(SlotCheck(b, errors[b], closest, errors[closest]))
    return out


def problems(checks: list[SlotCheck], tolerance: float, engine: str, num_layers: int,
             last_state: str = PRE_NORM) -> list[str]:
    """What is wrong with the slots, in words (empty: every slot is its own boundary within ``tolerance``)."""
    side = "before the final norm" if last_state == PRE_NORM else "after the final norm, as it returns it"
    out = []
    for c in checks:
        if c.ok(tolerance):
            continue
        said = f"boundary {c.boundary}" + (f" (the label state, {side})" if c.boundary == num_layers else "")
        if c.closest != c.boundary and c.closest_error <= tolerance:
            out.append(f"{engine}'s state for {said} is boundary {c.closest} here (relative error "
                       f"{c.closest_error:.1e}; {c.own:.1e} from its own)")
        else:
            out.append(f"{engine}'s state for {said} is no boundary here: relative error {c.own:.1e} from its own, "
                       f"{c.closest_error:.1e} from the closest (boundary {c.closest})")
    return out


def require_same_states(engine_states: torch.Tensor, slots: list[int], target: Target, token_ids: list[int],
                        engine: str, *, sequence: str, last_state: str = PRE_NORM) -> list[SlotCheck]:
    """The cross-check of one sequence; raises EngineCaptureError naming each slot that is another boundary.
    ``last_state`` POST_NORM: the engine's label slot is after the final norm, so it is compared with every boundary
    here normed."""
    tolerance = TOLERANCE.get(target.dtype, TOLERANCE[torch.bfloat16])
    here = states_here(target, token_ids)
    here_label = {b: normed(target, x) for b, x in here.items()} if last_state == POST_NORM else None
    checks = check_slots(engine_states, slots, here, here_label=here_label, label=target.num_layers)
    found = problems(checks, tolerance, engine, target.num_layers, last_state)
    if found:
        raise EngineCaptureError(
            f"the states {engine} captured for {sequence} are not the boundaries it was asked for (tolerance "
            f"{tolerance:g} relative error, from the {str(target.dtype).removeprefix('torch.')} capture): "
            + "; ".join(found) + ". Nothing was written from them: the engine numbers its layers otherwise than "
            "its reading eaglewire holds (engines/<engine>/readings.py), or its capture is broken; report it with "
            "this message")
    return checks


def split_states(states: torch.Tensor, slots: list[int], aux_boundaries: list[int],
                 num_layers: int, unnorm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, k*H] in the contract's order, last [T, H]) from the engine's [T, n, H] slots; ``unnorm`` [H]
    (``target_head.unnorm_weight``) where the label slot is after the final norm: stored as y / norm(1), whose
    norm is y again (as ``import-data --last-state post-norm`` stores it)."""
    T, _, H = states.shape
    index = [slots.index(b) for b in aux_boundaries]
    aux = states[:, index].reshape(T, len(index) * H)  # [T, k, H] -> [T, k*H]
    last = states[:, slots.index(num_layers)]
    return aux, last if unnorm is None else last / unnorm.to(last.device)


def require_last_layer(engine_states: torch.Tensor, slots: list[int], target: Target, token_ids: list[int],
                       engine: str, *, sequence: str, last_state: str = PRE_NORM) -> list[SlotCheck]:
    """The cross-check of a head-only target (``prepare --head-only``), which holds its embedding and its last
    decoder layer but not the others: the engine's label slot (boundary L) must be the last layer applied to the
    engine's own boundary L-1, and a boundary-0 slot the embedding output. An off-by-one label slot (boundary L-1
    handed as L) or a post-norm one fails this as it fails the full cross-check. Raises EngineCaptureError."""
    from eaglewire.model.target_head import boundary_zero, through_layer

    L = target.num_layers
    tolerance = TOLERANCE.get(target.dtype, TOLERANCE[torch.bfloat16])
    engine_states = engine_states.to(target.device)  # [T, n, H], where the last layer runs
    before = engine_states[:, slots.index(L - 1)]  # [T, H]
    last = engine_states[:, slots.index(L)]  # [T, H]
    expected = through_layer(target, L - 1, before)
    if last_state == POST_NORM:  # the engine's label slot after the final norm: compared with ours normed
        expected, before = normed(target, expected), normed(target, before)
    checks = [SlotCheck(L, relative_error(last, expected), L, relative_error(last, expected))]
    found = []
    if not checks[0].ok(tolerance):
        if relative_error(last, before) <= tolerance:
            found.append(f"{engine}'s state for boundary {L} (the label state, before the final norm) is its own "
                         f"boundary {L - 1}: the last layer was not applied (relative error {checks[0].own:.1e} "
                         f"from layer {L - 1} applied to its boundary {L - 1})")
        else:
            found.append(f"{engine}'s state for boundary {L} (the label state, before the final norm) is not layer "
                         f"{L - 1} applied to its boundary {L - 1}: relative error {checks[0].own:.1e} (a post-norm "
                         "state, or another layer)")
    if 0 in slots:
        error = relative_error(engine_states[:, slots.index(0)], boundary_zero(target, token_ids))
        checks.append(SlotCheck(0, error, 0, error))
        if not checks[-1].ok(tolerance):
            found.append(f"{engine}'s state for boundary 0 is not the embedding output: relative error {error:.1e}")
    if found:
        raise EngineCaptureError(
            f"the states {engine} captured for {sequence} are not the boundaries it was asked for (tolerance "
            f"{tolerance:g} relative error, from the {str(target.dtype).removeprefix('torch.')} head-only target, "
            "which holds the embedding and the last layer): " + "; ".join(found) + ". Nothing was written from "
            "them: the engine numbers its layers otherwise than its reading eaglewire holds "
            "(engines/<engine>/readings.py), or its capture is broken; report it with this message")
    return checks
