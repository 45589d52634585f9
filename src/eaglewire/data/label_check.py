"""The label check: do the stored boundary-L states give the target's own predictions?

Training, the stored-state doctor and every acceptance figure take the target's signal from
its final norm + lm_head applied to the stored last state (boundary L). A capture whose last
stored state is another layer (an import with the wrong ``--boundaries``) gives a draft wrong
labels that it learns well; nothing else notices. This module applies the head to the stored
last state of a sample of sequences, at every position whose next token is a stored reply token
(``loss_mask`` on it), and compares the head's argmax with that token.

Shapes: T tokens of one sequence, H hidden size, V target vocabulary.

The rule (constants below, in one place), by what is known, first match:

- **the target can run** (``prepare``, ``train`` with the full target): the target's own agreement on
  the same tokens, from its ordinary forward (``model(input_ids).logits``, independent of the
  capture hooks) on ``REFERENCE_SEQUENCES`` sequences, is the expectation. Refused when the stored
  states agree less than ``REFERENCE_MIN_RATIO`` x that, beyond twice the binomial noise. It
  covers greedy data too, and better: a reply re-tokenized through the template is not always
  the ids the target generated, and the reference sees the same tokens.
- **self-written greedy, head only** (``prepare --regenerate`` at temperature 0, read from the
  manifest's source): the replies are the target's own argmax, so the agreement is ~1 (SmolLM2-135M:
  0.997 honest, 0.508 from the state two layers below). Refused below ``GREEDY_MIN_AGREEMENT``.
- **otherwise, head only** (``import-data``, ``train --head-only``, ``doctor --stored``): the head's calibration.
  On text like the target's own, the head's mean cross-entropy on the stored next tokens is close
  to its own mean entropy; a state from another layer keeps the head confident but wrong, so the
  cross-entropy rises far above the entropy. Entropy alone does not separate them: measured on
  SmolLM2-135M, 12 ShareGPT conversations, 2,148 reply tokens, the states of boundaries 30 (L), 29,
  28 and 15 give agreement 0.678 / 0.477 / 0.440 / 0.072, entropy 1.43 / 1.61 / 1.26 / 1.06 nats
  (lower layers are no less confident) and cross-entropy minus entropy -0.06 / +1.86 / +3.34 /
  +17.7 nats. Refused when that gap exceeds ``CALIBRATION_MAX_GAP``. A target that is not a
  language model of the text (a random test target, a base model on a foreign language) fails
  this rule on honest data: ``--skip-label-check`` is for that case, and only that.

Positions: index t judges x_{t+1} where ``loss_mask[t+1]`` and the span goes on after it: the last
token of each reply span (the end-of-turn the template appends, which a reply cut at
``--max-new-tokens`` never generated) is not judged.

The diagnosis, on a fail (``LabelCheck.diagnosis``): a wrong last state is either another layer, or
boundary L on the other side of the final norm (HF's ``hidden_states[-1]`` and SpecForge's
``hidden_state`` are after it; eaglewire's boundary L is before it). The layer is right then, and no
``--boundaries`` fixes it: ``import-data --last-state`` does. The check reads the same judged positions
again as the other kind would have been stored, and judges that reading by the same rule and
constants: a state stored as pre-norm (as it is) is read as ``state / norm(1)``, exactly what
``import-data --last-state post-norm`` stores (an RMS norm is idempotent on unit-RMS vectors, so the head
then gives lm_head on the post-norm state); a state imported as post-norm (stored as ``y / norm(1)``,
the manifest's ``source.last_state``) is read as ``state * norm(1)``, what ``--last-state pre-norm``
stores. The other reading that passes, and agrees more often than the reading as stored, names the
fix (``"post-norm"`` / ``"pre-norm"``); else the other-layer cause stays (``"other-layer"``). Passing
alone is not enough: a flat reading is calibrated (cross-entropy = entropy = log V), and a wrong state
divided by a norm weight near 0 reads flat (a tiny random target with norm weights in [-1, 3]: the
state two layers below L read as post-norm agrees at 0.116 with cross-entropy - entropy -0.40 nats,
as stored 0.384). It needs only the final norm and lm_head, so it works head-only; top-K labels
store no state, so their fail is not diagnosed (``None``). Measured on SmolLM2-135M (final norm
weight from -2.1 to 3.3, mean 1.8), 12 ShareGPT conversations, 3,881 reply positions (agreement /
cross-entropy minus entropy):

| stored last state                        | as stored           | the other reading |
|------------------------------------------|---------------------|-------------------|
| boundary 30 (L), pre-norm                | 0.648 / -0.07       | 0.149 / +11.19    |
| boundary 30 post-norm, stored pre-norm   | 0.258 / +4.59 fail  | 0.648 / -0.07     |
| boundary 30 pre-norm, imported post-norm | 0.149 / +11.19 fail | 0.648 / -0.07     |
| boundary 29, pre-norm                    | 0.456 / +1.78 fail  | 0.018 / +12.70    |
| boundary 28, pre-norm                    | 0.427 / +3.16 fail  | 0.086 / +6.98     |
| boundary 15, pre-norm                    | 0.096 / +18.42 fail | 0.000 / +23.45    |

(the post-norm state rounded to bf16, as shards store it, reads 0.648 / -0.07 too).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from eaglewire.model.target import Target
from eaglewire.model.target_head import HeadOnlyError, unnorm_weight

log = logging.getLogger(__name__)

SAMPLE_SEQUENCES = 16  # sequences read from the shards (evenly spread)
SAMPLE_POSITIONS = 4096  # judged positions at most (the head is a [H, V] matmul per position)
REFERENCE_SEQUENCES = 4  # sequences the target runs on for its own rate
MIN_POSITIONS = 16  # fewer judged positions: no verdict ("skip")
GREEDY_MIN_AGREEMENT = 0.9  # self-written greedy data: the honest capture measures 0.997
REFERENCE_MIN_RATIO = 0.9  # of the target's own agreement on the same tokens
REFERENCE_NOISE_SIGMAS = 2.0  # binomial noise allowed below that
CALIBRATION_MAX_GAP = 1.0  # nats of cross-entropy above entropy (honest -0.06, one layer below +1.86)

PRE_NORM, POST_NORM, OTHER_LAYER = "pre-norm", "post-norm", "other-layer"
LAST_STATES = (PRE_NORM, POST_NORM)  # how a shard's last state was stored: manifest source.last_state
OTHER_SIDE = {PRE_NORM: POST_NORM, POST_NORM: PRE_NORM}

BOUNDARIES_CAUSE = ("the likely cause: the stored last state is not boundary L = {L} (the last layer's output "
                    "before the final norm, of this {L}-layer target). With import-data, the last value of "
                    "--boundaries must name the state that is boundary {L} (vLLM/speculators layer id {L}); "
                    "check which layer the capturing tool stored last")
OTHER_READING = " (read as the other side of the final norm it fails too: {figures})"
TOPK_UNDIAGNOSED = (" (top-K labels store no state, so whether it is another layer or boundary {L} on the other "
                    "side of the final norm, import-data --last-state, cannot be told from them)")
NORM_CAUSES = {
    POST_NORM: ("the likely cause: the stored last state is boundary L = {L} AFTER the final norm (the post-norm "
                "state: HF's hidden_states[-1], SpecForge's hidden_state), stored as the pre-norm one; read as "
                "post-norm (mapped back through the final norm) it gives {figures}. The layer is right, the norm "
                "is not"),
    PRE_NORM: ("the likely cause: the stored last state was imported as post-norm (mapped back through the final "
               "norm) but is boundary L = {L} BEFORE the final norm (the pre-norm state); read as pre-norm it "
               "gives {figures}. The layer is right, the norm is not"),
}
NORM_FIXES = {side: f": re-import with `eaglewire import-data ... --last-state {side}`"  # shards from import-data
              for side in (POST_NORM, PRE_NORM)}
NORM_CAPTURE_FIXES = {  # shards written by eaglewire's own capture (prepare)
    POST_NORM: ": the capture stored the state after the final norm; capture boundary L before it",
    PRE_NORM: ": the shards record their last state as post-norm but hold the pre-norm one",
}
REIMPORT_FIXES = {  # the words after "re-import" / "import again", by diagnosis
    POST_NORM: "with --last-state post-norm (the stored last state is boundary {L} after the final norm; the "
               "import maps it back through the norm)",
    PRE_NORM: "with --last-state pre-norm (the stored last state is boundary {L} before the final norm; the "
              "import takes it as stored)",
    OTHER_LAYER: "with --boundaries whose last value names the stored state that is boundary {L} (or capture it "
                 "again)",
}
SKIP_HINT = ("if the target is not a language model of this text (a random test target), pass "
             "--skip-label-check")


@dataclass(frozen=True)
class Figures:
    """What the head says at the judged positions."""

    positions: int = 0
    agree: int = 0
    entropy: float = 0.0  # summed, nats
    cross_entropy: float = 0.0  # summed, nats

    def __add__(self, other: Figures) -> Figures:
        return Figures(self.positions + other.positions, self.agree + other.agree,
                       self.entropy + other.entropy, self.cross_entropy + other.cross_entropy)

    @property
    def agreement(self) -> float:
        return self.agree / max(self.positions, 1)

    @property
    def mean_entropy(self) -> float:
        return self.entropy / max(self.positions, 1)

    @property
    def gap(self) -> float:
        """Mean cross-entropy on the stored next tokens minus mean entropy, nats."""
        return (self.cross_entropy - self.entropy) / max(self.positions, 1)

    def describe(self) -> str:
        return (f"argmax agrees with the stored next token at {self.agreement:.3f} of {self.positions:,} positions, "
                f"mean entropy {self.mean_entropy:.2f} nats, cross-entropy - entropy {self.gap:+.2f} nats")


@dataclass(frozen=True)
class LabelCheck:
    """The verdict (``ok``, ``fail`` or ``skip``), a message naming the figures, and the figures."""

    verdict: str
    message: str
    rule: str  # "greedy", "reference" or "calibration"
    stored: Figures
    sequences: int
    reference: Figures | None = None  # the target's own forward on the reference sequences
    stored_on_reference: Figures | None = None  # the stored states on those same sequences
    details: dict[str, Any] = field(default_factory=dict)
    # on a fail: "post-norm" / "pre-norm" (boundary L on the other side of the final norm than it was stored
    # as: the fix is import-data --last-state <it>), "other-layer" (neither reading passes), None (not diagnosed:
    # no fail, top-K labels, a final norm with a bias)
    diagnosis: str | None = None
    other_reading: Figures | None = None  # the judged positions read as the other side of the final norm

    @property
    def norm_side_wrong(self) -> bool:
        """The stored last state is boundary L, stored as the wrong side of the final norm."""
        return self.diagnosis in LAST_STATES

    @property
    def ok(self) -> bool:
        return self.verdict != "fail"

    def to_dict(self) -> dict[str, Any]:
        out = {"verdict": self.verdict, "rule": self.rule, "sequences": self.sequences,
               "positions": self.stored.positions, "agreement": round(self.stored.agreement, 4),
               "mean_entropy": round(self.stored.mean_entropy, 4), "gap_nats": round(self.stored.gap, 4)}
        if self.reference is not None:
            out["reference_agreement"] = round(self.reference.agreement, 4)
        if self.diagnosis is not None:
            out["diagnosis"] = self.diagnosis
        if self.other_reading is not None:
            out["other_reading"] = {"agreement": round(self.other_reading.agreement, 4),
                                    "gap_nats": round(self.other_reading.gap, 4)}
        return out


class LabelCheckError(ValueError):
    """Stored states whose boundary-L state does not give the target's predictions."""

    def __init__(self, check: LabelCheck, where: str):
        super().__init__(f"{where}: {check.message}")
        self.check = check


def judged_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[T] bool: index t judges x_{t+1} (a reply token that is not its span's last). loss_mask [T] bool."""
    mask = loss_mask.bool()
    out = torch.zeros_like(mask)
    out[:-2] = mask[1:-1] & mask[2:]  # [T]
    return out


def figures(logits: torch.Tensor, input_ids: torch.Tensor, judged: torch.Tensor) -> Figures:
    """Figures of logits [T, V] (index t predicting x_{t+1}) at ``judged`` [T] positions."""
    nxt = torch.zeros_like(input_ids)
    nxt[:-1] = input_ids[1:]  # [T] the next token
    logp = logits[judged].float().log_softmax(-1)  # [n, V]
    target_logp = logp.gather(-1, nxt[judged].to(logp.device)[:, None])[:, 0]  # [n]
    return Figures(positions=int(judged.sum()),
                   agree=int((logp.argmax(-1) == nxt[judged].to(logp.device)).sum()),
                   entropy=float(-(logp.exp() * logp).sum()),
                   cross_entropy=float(-target_logp.sum()))


def can_run(target: Target) -> bool:
    """Whether the target's layers hold weights (a head-only target's are on the meta device)."""
    return not any(p.is_meta for p in target.layers.parameters())


def is_self_written_greedy(source: dict[str, Any]) -> bool:
    """A manifest source recording ``prepare --regenerate`` at temperature 0."""
    regen = source.get("regenerate") if isinstance(source, dict) else None
    return bool(source.get("regenerated")) and isinstance(regen, dict) and float(regen.get("temperature", 1)) == 0


def sample_indices(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n) (all of them when n <= k)."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)}) if k > 1 else [0]


def stored_last_state(source: dict[str, Any]) -> str:
    """How the shards' last state was stored (``LAST_STATES``): the manifest source's ``last_state``; a
    manifest from before that field says ``post-norm`` in its ``last_hidden`` (SpecForge imports)."""
    if isinstance(source, dict) and source.get("last_state") in LAST_STATES:
        return source["last_state"]
    return POST_NORM if isinstance(source, dict) and POST_NORM in str(source.get("last_hidden", "")) else PRE_NORM


def other_side_factor(norm_scale: torch.Tensor, stored_as: str) -> torch.Tensor:
    """[H] the factor that turns a stored last state into the other kind's stored form. ``norm_scale``
    [H] is the final norm of ones (``unnorm_weight``). A state stored as pre-norm read as post-norm:
    1 / norm(1), as ``import-data --last-state post-norm`` stores it (norm(y / norm(1)) == y for a post-norm
    y). A state imported as post-norm (y / norm(1)) read back as pre-norm: * norm(1), the state as captured."""
    return 1 / norm_scale if stored_as == PRE_NORM else norm_scale


@torch.no_grad()
def _stored_figures(reader, index: int, target: Target, budget: int, factor: torch.Tensor | None = None) -> Figures:
    """Figures of the head on the stored last state of sequence ``index`` (times ``factor`` [H] if given)."""
    item = reader[index]
    ids, judged = item["input_ids"], judged_positions(item["loss_mask"])  # [T], [T]
    if int(judged.sum()) > budget:  # keep the first `budget` judged positions
        judged &= torch.cumsum(judged.long(), 0) <= budget
    if not judged.any():
        return Figures()
    if "topk_ids" in item:  # --labels topk:K: the head was applied when the shards were written
        return topk_figures(item["topk_logprobs"], item["topk_ids"], ids, judged)
    last = item["last_hidden"][judged].float()  # [n, H]
    if factor is not None:
        last = last * factor.to(last.device)  # [n, H]
    logits = torch.zeros(len(ids), target.vocab_size)
    logits[judged] = target.head(last.to(target.device, target.dtype)).float().cpu()  # [n, V] into [T, V]
    return figures(logits, ids, judged)


def _sample_figures(reader, target: Target, picked: list[int], factor: torch.Tensor | None = None
                    ) -> list[tuple[int, Figures]]:
    """(sequence index, figures) of the picked sequences, until ``SAMPLE_POSITIONS`` are judged."""
    per_seq, budget = [], SAMPLE_POSITIONS
    for i in picked:
        if budget <= 0:
            break
        f = _stored_figures(reader, i, target, budget, factor)
        per_seq.append((i, f))
        budget -= f.positions
    return per_seq


def topk_figures(logprobs: torch.Tensor, topk_ids: torch.Tensor, input_ids: torch.Tensor,
                 judged: torch.Tensor) -> Figures:
    """Figures from stored top-K labels: logprobs / topk_ids [T, K] (descending), input_ids [T],
    judged [T] bool. The agreement is exact (the top-1 is the head's argmax). The tail beyond K is
    not stored, so both sums are lower bounds: a next token outside the top K costs the K-th
    log-probability (its own is at most that), and the entropy sums the K stored terms only."""
    nxt = torch.zeros_like(input_ids)
    nxt[:-1] = input_ids[1:]  # [T] the next token
    lp, top, want = logprobs[judged].float(), topk_ids[judged].long(), nxt[judged].long()  # [n, K] [n, K] [n]
    hit = top == want[:, None]  # [n, K]
    target_lp = torch.where(hit.any(-1), (lp * hit).sum(-1), lp[:, -1])  # [n]
    return Figures(positions=int(judged.sum()), agree=int((top[:, 0] == want).sum()),
                   entropy=float(-(lp.exp() * lp).sum()), cross_entropy=float(-target_lp.sum()))


@torch.no_grad()
def _reference_figures(reader, index: int, target: Target) -> Figures:
    """The target's ordinary forward on the stored tokens (not the capture hooks)."""
    item = reader[index]
    ids, judged = item["input_ids"], judged_positions(item["loss_mask"])  # [T], [T]
    logits = target.model(input_ids=ids[None].to(target.device)).logits[0].float().cpu()  # [T, V]
    return figures(logits, ids, judged)


@dataclass(frozen=True)
class Judgement:
    """One reading of the stored states judged by the rule: passes or not, and what was expected."""

    ok: bool
    expect: str
    on_reference: Figures | None = None  # the reading on the reference sequences (rule "reference")


def judge(rule: str, per_seq: list[tuple[int, Figures]], reference: Figures | None = None,
          reference_ids: tuple[int, ...] = ()) -> Judgement:
    """The verdict rule (module docstring) on one reading: ``per_seq`` (sequence index, figures), and
    for rule "reference" the target's own figures on the sequences ``reference_ids``."""
    stored = sum((f for _, f in per_seq), Figures())
    if rule == "greedy":
        return Judgement(stored.agreement >= GREEDY_MIN_AGREEMENT,
                         f"on the target's own greedy replies (prepare --regenerate, temperature 0) at least "
                         f"{GREEDY_MIN_AGREEMENT} is expected (an honest capture measures ~0.997)")
    if rule == "reference":
        mine = sum((f for i, f in per_seq if i in reference_ids), Figures())
        p = reference.agreement
        floor = REFERENCE_MIN_RATIO * p - REFERENCE_NOISE_SIGMAS * math.sqrt(p * (1 - p) / max(mine.positions, 1))
        return Judgement(mine.agreement >= floor,
                         f"on {len(reference_ids)} of these sequences the stored states agree at {mine.agreement:.3f}, "
                         f"the target's own forward at {p:.3f} (at least {max(floor, 0):.3f} expected: "
                         f"{REFERENCE_MIN_RATIO} x its rate less binomial noise)", on_reference=mine)
    return Judgement(stored.gap <= CALIBRATION_MAX_GAP,
                     f"the head's cross-entropy on the stored next tokens should be close to its own entropy (at "
                     f"most {CALIBRATION_MAX_GAP} nats above; a state from another layer leaves the head confident "
                     "but wrong)")


def stores_labels_only(reader) -> bool:
    """Shards with top-K labels (``--labels topk:K``): the head was applied at writing, no state is stored."""
    return getattr(reader, "labels_mode", "hidden") == "topk"


def _norm_scale(target: Target) -> torch.Tensor | None:
    """[H] the final norm of ones, or None for a norm that cannot be mapped through (a bias)."""
    try:
        return unnorm_weight(target).cpu()
    except HeadOnlyError:
        return None


def diagnose(reader, target: Target, rule: str, picked: list[int], stored: Figures, reference: Figures | None = None,
             reference_ids: tuple[int, ...] = ()) -> tuple[str | None, Figures | None]:
    """(diagnosis, figures of the other reading) of a failed check: the same positions read as the other
    side of the final norm, judged by the same rule, and agreeing more often than ``stored`` (the
    reading as stored) (module docstring). None: no state to read again."""
    if stores_labels_only(reader):
        return None, None
    scale = _norm_scale(target)
    if scale is None:
        return None, None
    stored_as = stored_last_state(reader.manifest.get("source") or {})
    per_seq = _sample_figures(reader, target, picked, other_side_factor(scale, stored_as))
    other = sum((f for _, f in per_seq), Figures())
    passes = judge(rule, per_seq, reference, reference_ids).ok and other.agreement > stored.agreement
    return (OTHER_SIDE[stored_as] if passes else OTHER_LAYER), other


def cause(diagnosis: str | None, num_layers: int, other: Figures | None, *, imported: bool) -> str:
    """The likely cause of a fail and its fix, by the diagnosis (``imported``: shards from import-data)."""
    if diagnosis in LAST_STATES:
        fixes = NORM_FIXES if imported else NORM_CAPTURE_FIXES
        return NORM_CAUSES[diagnosis].format(L=num_layers, figures=other.describe()) + fixes[diagnosis]
    text = BOUNDARIES_CAUSE.format(L=num_layers)
    if diagnosis == OTHER_LAYER and other is not None:
        return text + OTHER_READING.format(figures=other.describe())
    return text


def reimport_fix(diagnosis: str | None, num_layers: int) -> str:
    """How to import a refused capture again, by the diagnosis: the words after "re-import" / "import again"."""
    return REIMPORT_FIXES[diagnosis if diagnosis in REIMPORT_FIXES else OTHER_LAYER].format(L=num_layers)


def check_labels(reader, target: Target, *, greedy: bool | None = None, reference: bool | None = None,
                 num_sequences: int = SAMPLE_SEQUENCES) -> LabelCheck:
    """The label check on a shard reader (``ShardDataset``) with ``target``'s head.

    ``reference``: run the target for its own rate (default: when its layers hold weights); the
    expectation then, whatever the data. Else ``greedy``: the data are the target's own greedy replies
    (default: from the manifest's source). Else the head's calibration. A fail is diagnosed
    (``LabelCheck.diagnosis``): another layer, or boundary L on the other side of the final norm.
    """
    source = reader.manifest.get("source") or {}
    greedy = is_self_written_greedy(source) if greedy is None else greedy
    reference = can_run(target) if reference is None else reference
    L = reader.contract.num_layers
    picked = sample_indices(len(reader), num_sequences)
    per_seq = _sample_figures(reader, target, picked)
    stored = sum((f for _, f in per_seq), Figures())
    rule = "reference" if reference else "greedy" if greedy else "calibration"
    if stored.positions < MIN_POSITIONS:
        return LabelCheck("skip", f"only {stored.positions} reply positions to judge in {len(per_seq)} sequences "
                          f"(at least {MIN_POSITIONS} needed): not checked", rule, stored, len(per_seq))
    ref, ref_ids = None, ()
    if rule == "reference":
        ref_ids = tuple([i for i, f in per_seq if f.positions][:REFERENCE_SEQUENCES])
        ref = sum((_reference_figures(reader, i, target) for i in ref_ids), Figures())
    verdict = judge(rule, per_seq, ref, ref_ids)
    what = f"the target's final norm + lm_head on the stored last state: {stored.describe()}"
    found = dict(reference=ref, stored_on_reference=verdict.on_reference)
    if verdict.ok:
        return LabelCheck("ok", f"{what}; {verdict.expect}", rule, stored, len(per_seq), **found)
    diagnosis, other = diagnose(reader, target, rule, picked, stored, ref, ref_ids)
    why = cause(diagnosis, L, other, imported="imported_from" in source)
    if stores_labels_only(reader):
        why += TOPK_UNDIAGNOSED.format(L=L)
    hint = f"; {SKIP_HINT}" if rule == "calibration" and diagnosis not in LAST_STATES else ""
    return LabelCheck("fail", f"{what}; {verdict.expect}. {why}{hint}", rule, stored, len(per_seq), **found,
                      diagnosis=diagnosis, other_reading=other)


def require_labels(reader, target: Target, *, where: str, **kwargs) -> LabelCheck:
    """``check_labels``, raising ``LabelCheckError`` on a fail; logs the figures either way."""
    check = check_labels(reader, target, **kwargs)
    log.info("label check (%s, %s): %s", where, check.rule, check.message)
    if check.verdict == "fail":
        raise LabelCheckError(check, where)
    return check
