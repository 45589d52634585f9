"""Which boundary each stored state is: stored slots matched against every boundary of a fresh capture.

A capture tool records states, not which layers they are, and its ids are its own convention (SpecForge id i
is the output of layer i, boundary i + 1; a vLLM id is the boundary itself). A state imported one layer off
trains a draft that every check on that data passes, and that fails against the target. The states say
which boundary they are: run the target on a few stored sequences' tokens, capture every boundary 0..L, and
each stored slot is closest to the boundary it was captured at. The comparison is ``engine_capture``'s
(``check_slots``: per-token relative error, mean over tokens, since an attention sink at token 0 dominates a
norm over [T, H]), over the sequences' tokens together.

Shapes: T tokens (of all the sequences compared), n stored slots, H hidden size, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglewire.data.engine_capture import TOLERANCE as ENGINE_TOLERANCE
from eaglewire.data.engine_capture import SlotCheck, check_slots, states_here
from eaglewire.model.target import Target

# The precision the stored states were computed in is not recorded (a bf16 engine may store fp32): bf16's
# tolerance, the loosest. A state one layer off is 2.4x beyond it on SmolLM2-135M (engine_capture.TOLERANCE).
TOLERANCE = ENGINE_TOLERANCE[torch.bfloat16]
SEQUENCES = 4  # stored sequences the target is run on
MAX_TOKENS = 256  # of each


@dataclass(frozen=True)
class Identification:
    """Each stored slot against every boundary of a fresh capture (``checks[j]``: the j-th slot compared, said to
    be ``boundary``; ``slots[j]``: its index among the stored states, where only some were compared;
    ``num_layers``: L, the capture's last boundary)."""

    checks: list[SlotCheck]
    sequences: int
    tokens: int
    tolerance: float = TOLERANCE
    slots: tuple[int, ...] | None = None
    num_layers: int | None = None

    def slot(self, j: int) -> int:
        return self.slots[j] if self.slots is not None else j

    def misread(self) -> list[tuple[int, SlotCheck]]:
        """(slot, check) of each slot that is another boundary than it is said to be, within tolerance."""
        return [(j, c) for j, c in enumerate(self.checks)
                if c.closest != c.boundary and c.closest_error <= self.tolerance]

    def unmatched(self) -> list[tuple[int, SlotCheck]]:
        """(slot, check) of each slot no boundary here is within tolerance of (another precision or quantization,
        another target, or no boundary at all)."""
        return [(j, c) for j, c in enumerate(self.checks) if c.closest_error > self.tolerance]

    @property
    def ok(self) -> bool:
        return not self.misread()

    @property
    def said(self) -> list[int]:
        return [c.boundary for c in self.checks]

    def corrected(self) -> dict[int, int]:
        """said boundary -> the boundary it is, for every misread slot."""
        return {c.boundary: c.closest for _, c in self.misread()}

    def shift(self) -> int | None:
        """The one offset (is - said) every misread slot shares, else None."""
        shifts = {c.closest - c.boundary for _, c in self.misread()}
        return shifts.pop() if len(shifts) == 1 else None

    def what(self) -> str:
        """The sample compared, for messages."""
        return (f"{self.sequences} sequence(s), {self.tokens:,} tokens; per-token relative error, tolerance "
                f"{self.tolerance:g}")

    def lines(self, said_as: str = "stored as") -> list[str]:
        """One line per misread or unmatched slot (``said_as``: how a slot came to be said its boundary)."""
        out = []
        for j, c in self.misread():
            out.append(f"slot {self.slot(j)} ({said_as} boundary {c.boundary}) is boundary {c.closest}: relative error "
                       f"{c.closest_error:.1e} from boundary {c.closest}, {c.own:.1e} from boundary {c.boundary}")
        for j, c in self.unmatched():
            out.append(f"slot {self.slot(j)} ({said_as} boundary {c.boundary}) is no boundary of this capture: "
                       f"relative error {c.own:.1e} from boundary {c.boundary}, {c.closest_error:.1e} from the closest "
                       f"(boundary {c.closest})")
        return out

    def cause(self) -> str:
        """Why the slots are one off, where every misread slot is off by the same one layer."""
        shift = self.shift()
        if shift == 1 and [c.closest for _, c in self.misread()] == [self.num_layers]:
            L = self.num_layers
            return (f"the misread slot is the last layer's output, boundary {L} (before the final norm): boundary b "
                    f"is the input of layer b, so the last layer's index ({L - 1}, counting from 0) names the "
                    "boundary below it")
        if shift == 1:
            return ("every misread slot is one layer above what was said: the capture's ids number layer outputs "
                    "(SpecForge and SGLang on Llama-family targets: id i is the output of layer i, boundary i + 1) "
                    "and were taken as boundaries (inputs of layers)")
        if shift == -1:
            return ("every misread slot is one layer below what was said: the capture's ids were boundaries "
                    "already (vLLM and speculators: id b is boundary b) and were taken as layer outputs (+1)")
        return ""


def fix_boundaries(boundaries: list[int], corrected: dict[int, int]) -> list[int] | None:
    """``boundaries`` with each misread one replaced by the boundary it is; None when two would then name one
    boundary (no single --boundaries describes such a capture)."""
    out = [corrected.get(b, b) for b in boundaries]
    return out if len(set(out)) == len(out) else None


def match_slots(stored: list[torch.Tensor], fresh: list[dict[int, torch.Tensor]], said: list[int]
                ) -> list[SlotCheck]:
    """Stored slots (``stored[i]``: sequence i, [T_i, n, H], slot j said to be boundary ``said[j]``) against every
    boundary of a fresh capture of the same tokens (``fresh[i]``: boundary -> [T_i, H]), all sequences' tokens
    together."""
    states = torch.cat([s.float() for s in stored])  # [T, n, H]
    here = {b: torch.cat([f[b].float() for f in fresh]) for b in fresh[0]}  # boundary -> [T, H]
    return check_slots(states, said, here)


def identify(target: Target, samples: list[tuple[list[int], torch.Tensor]], said: list[int], *,
             max_tokens: int = MAX_TOKENS, slots: list[int] | None = None) -> Identification:
    """Run ``target`` on each sample's token ids (``samples``: (ids, stored [T, n, H]), the first ``max_tokens``
    of each) and match the stored slots against every boundary it captures (``said[j]``: slot j's boundary;
    ``slots``: the slots' indices among all stored states, for messages, where only some are compared)."""
    stored, fresh = [], []
    for ids, states in samples:
        ids = list(ids)[:max_tokens]
        stored.append(states[:len(ids)].to(target.device))
        fresh.append(states_here(target, ids))
    return Identification(match_slots(stored, fresh, said), sequences=len(samples),
                          tokens=sum(s.shape[0] for s in stored), slots=None if slots is None else tuple(slots),
                          num_layers=target.num_layers)
