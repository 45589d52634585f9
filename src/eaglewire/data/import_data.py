"""``eaglewire import-data``: hidden states captured by vLLM, speculators or SpecForge -> shards.

Shapes: T tokens of one sample, n states stored per token, k aux boundaries, H hidden size.

The sources record states, not which layers they are, so the contract is built from what
the caller states (``--boundaries``, in eaglewire's numbering) and the target's fingerprint;
an import refuses rather than guess. Samples stream one file at a time into a resumable
``ShardWriter`` in ``OUT.partial``, renamed to ``OUT`` once complete, so ``OUT`` is never
half-written. A sample that fails a check (unreadable, wrong shape, NaN/inf, token ids that
differ from the dataset's) is skipped, logged and counted in the manifest's ``source``.

Post-norm sources (``--last-state post-norm``, SpecForge's default: its final state is after the
final norm; any layout's stored boundary-L state can be): shards hold the pre-norm boundary L,
to which every consumer applies final norm + lm_head. The norm cannot be undone, but an RMS norm
is idempotent on unit-RMS vectors, so the import stores u = y / norm(1) (norm(1) is the norm's
per-channel scale), and norm(u) == y up to its eps: the head then gives the capture's logits.
That needs the target's final norm weight (read alone, never the model), and is recorded in the
manifest (``source.last_state``). ``--last-state pre-norm`` takes the state as boundary L as it is
(vLLM's and speculators' default; for SpecForge, a final state captured before the norm). A wrong
side fails the label check, which names the side that passes (``label_check.py``).

The boundaries are checked too where the target can run (``--identify-boundaries``): before anything is
written, the first samples' tokens go through the target and each stored state is matched against every
boundary it captures (``boundary_match.py``); a state that is another boundary than ``--boundaries`` says
(ids that number layer outputs taken as inputs: one layer off) refuses the import, naming the slots and the
import line with the boundaries the states are. ``--boundaries`` without L are identified before they are refused,
so a boundary-L state said to be another names the slot. A target over ``IDENTIFY_MAX_BYTES`` is loaded only when
asked.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import shlex
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from eaglewire.core.configs import config_record
from eaglewire.core.contract import HiddenStateContract, TargetFingerprint, validate_aux_boundaries, validate_boundaries
from eaglewire.data import boundary_match
from eaglewire.data.foreign import (LAYOUT_LAST_STATE, LAYOUTS, ForeignDataError, Sample, Skip, read_rows,
                                    read_specforge, read_speculators, read_vllm)
from eaglewire.data.label_check import (LAST_STATES, POST_NORM, PRE_NORM, SKIP_HINT, LabelCheckError,
                                        check_labels, reimport_fix)
from eaglewire.data.shards import DTYPES, ShardDataset, ShardError, ShardWriter
from eaglewire.data.state_codec import STATE_DTYPES, Storage
from eaglewire.core.fileio import replace_dir
from eaglewire.core.locks import directory_lock
from eaglewire.model.target import Target, load_target, resolve_target_path
from eaglewire.model.target_head import config_fingerprint, load_target_head, tensor_locations, unnorm_weight

log = logging.getLogger(__name__)

# manifest source.last_hidden of shards without a boundary-L state (train and the head refuse them)
ABSENT_LAST = "absent (zeros)"
IDENTIFY = ("auto", "yes", "no")
IDENTIFY_MAX_BYTES = 8 * 2**30  # --identify-boundaries auto loads a target up to this size (weights on disk)
BOUNDARY_HELP = ("eaglewire boundary b = input of layer b (0 = embedding output, L = last layer before the "
                 "final norm). vLLM and speculators ids are boundaries verbatim; SpecForge id i is boundary i + 1")


@dataclass(kw_only=True)
class ImportDataConfig:
    src: str = field(metadata={"positional": True, "help": "the directory of captured states"})
    layout: str = field(metadata={"flag": "from", "choices": LAYOUTS, "help": "whose capture it is"})
    out: str = field(metadata={"help": "shard directory to create (must not exist)"})
    target: str = field(metadata={"help": "the target's model directory: config.json (+ tokenizer) is enough; "
                                          "with weights, only the embedding, final norm and lm_head are read"})
    boundaries: list[int] | None = field(default=None, metadata={
        "help": "boundary of every stored state, in stored order (SpecForge: its aux states only)"})
    aux_boundaries: list[int] | None = field(default=None, metadata={
        "help": "stored boundaries the shards' aux holds, in order (default: every stored one but L)"})
    tokens: str | None = field(default=None, metadata={
        "help": "rows with input_ids and loss_mask: a datasets directory (save_to_disk), parquet or jsonl "
                "(speculators: row i = hs_i, default the datasets directory the states are in, i.e. "
                "--preprocessed-data; vllm: rows by id, checks token_ids and adds the loss mask)"})
    dtype: str = field(default="bf16", metadata={"help": "stored hidden dtype: bf16 or fp16"})
    shard_mb: int = field(default=512, metadata={"help": "approximate shard size; bounds the memory in use"})
    no_last: bool = field(default=False, metadata={
        "help": "the capture holds no boundary-L state: store zeros in its place (for doctor --stored --labels "
                "tokens; train refuses such shards)"})
    skip_label_check: bool = field(default=False, metadata={
        "help": "import without the label check (the target's head on the stored last state against the stored "
                "next tokens); only for a target that is not a language model of this text, e.g. a random test "
                "target", "record": False})
    state_dtype: str | None = field(default=None, metadata={"choices": STATE_DTYPES, 
        "help": "aux states on disk: fp8 (e4m3 with a scale per token and boundary) or bf16/fp16 (default: --dtype)"})
    labels: str = field(default="hidden", metadata={
        "help": "the target's signal on disk: hidden (the boundary-L state) or topk:K (the target head's K most "
                "likely tokens at reply positions; needs the weights in --target)"})
    last_state: str | None = field(default=None, metadata={"choices": LAST_STATES, "help":
        "which side of the final norm the stored boundary-L state is on: pre-norm (the last layer's output, "
        "boundary L as is) or post-norm (after the final norm, HF's hidden_states[-1]: mapped back through the "
        "final norm, which needs the weights in --target). Default: the layout's (specforge post-norm, vllm and "
        "speculators pre-norm)"})
    identify_boundaries: str = field(default="auto", metadata={"choices": IDENTIFY, "help":
        "run the target on the first samples' tokens and match each stored state against every boundary it "
        "captures; an import whose --boundaries name other layers than the states are is refused, with the line "
        "that imports them right. auto: when --target holds weights of at most 8 GiB; yes: whatever their size "
        "(the whole target is loaded); no: skip"})

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"--from {self.layout!r} is not a known layout; choose one of {', '.join(LAYOUTS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not a shard dtype; choose one of {', '.join(DTYPES)}")
        if self.shard_mb < 1:
            raise ValueError(f"--shard-mb must be >= 1, got {self.shard_mb}")
        storage = Storage(dtype=self.dtype, state_dtype=self.state_dtype, labels=self.labels)  # names the bad flag
        if storage.labels_mode == "topk" and self.no_last:
            raise ValueError(f"--labels {self.labels} computes the target's top-K from the boundary-L state, which "
                             "--no-last says the capture lacks; import with --labels hidden")
        if self.last_state is not None and self.last_state not in LAST_STATES:
            raise ValueError(f"--last-state {self.last_state!r} is not one of {', '.join(LAST_STATES)}")
        if self.identify_boundaries not in IDENTIFY:
            raise ValueError(f"--identify-boundaries {self.identify_boundaries!r} is not one of {', '.join(IDENTIFY)}")
        if self.last_state is not None and self.no_last:
            raise ValueError(f"--last-state {self.last_state} names the side of the final norm of a boundary-L "
                             "state that --no-last says the capture lacks; pass one of them")

    @property
    def stored_last_state(self) -> str:
        """The side of the final norm the capture's boundary-L state is on: --last-state, else the layout's."""
        return self.last_state or LAYOUT_LAST_STATE[self.layout]


class NoLastStateError(ForeignDataError):
    """``--boundaries`` (``stored``) name no boundary-L state, and --no-last is not passed."""

    def __init__(self, stored: list[int], num_layers: int):
        super().__init__(
            f"--boundaries {stored}: none is boundary {num_layers} (the last layer's state before the final "
            f"norm, of this {num_layers}-layer target), which training needs as the target's signal. "
            f"Capture it too (layer id {num_layers} in vLLM/speculators), or pass --no-last to import the "
            "states for doctor --stored --labels tokens only")
        self.stored = stored


@dataclass
class Plan:
    """Where each shard tensor comes from: stored state indices for aux (in order) and for L."""

    stored: list[int]  # boundary of each stored state
    aux_index: list[int]  # indices into stored, in the contract's aux order
    last_index: int | None  # index of boundary L among the stored, None for a separate final state or none
    absent: bool = False  # no boundary-L state at all (--no-last): zeros stand in
    last_state: str = PRE_NORM  # the side of the final norm it was captured on (post-norm: mapped back)


@dataclass
class ImportSummary:
    out: Path
    contract: HiddenStateContract
    sequences: int
    tokens: int
    skipped: dict[str, int]
    unknown: list[str]
    notes: list[str] = field(default_factory=list)

    def rows(self) -> list[tuple[str, str]]:
        rows = [("aux boundaries", str(list(self.contract.aux_boundaries))),
                ("sequences", f"{self.sequences:,}"), ("tokens", f"{self.tokens:,}")]
        rows += [(f"skipped: {why}", f"{n:,}") for why, n in sorted(self.skipped.items())]
        return rows + [("note", n) for n in self.notes]


def _target(spec: str) -> tuple[TargetFingerprint, torch.Tensor | None, list[str], Target | None]:
    """(fingerprint, the final norm's scale or None, fingerprint fields unknown, the head-only target or None)."""
    try:
        target = load_target_head(spec)
    except ValueError as e:  # no weights or no tokenizer (HeadOnlyError is one too)
        log.info("%s; recording what its config says", e)
        fingerprint, unknown = config_fingerprint(spec)
        return fingerprint, None, unknown, None
    return target.fingerprint, unnorm_weight(target), [], target


def make_plan(config: ImportDataConfig, first: Sample, num_layers: int) -> Plan:
    """The stored boundaries and the aux/last picks, from the flags and the first sample."""
    n = first.states.shape[1] if first.states.ndim == 3 else None
    if n is None:
        raise ForeignDataError(f"sample {first.seq_id}: hidden states {list(first.states.shape)} are not "
                               "[T, n, H] (tokens, stored states, hidden)")
    separate = first.final_state is not None  # SpecForge: the boundaries name the aux states only
    if config.boundaries is None:
        what = "aux states" if separate else "states"
        raise ForeignDataError(f"{n} {what} stored per token, their layers not recorded: pass --boundaries "
                               f"with {n} values ({BOUNDARY_HELP})")
    stored = validate_boundaries(list(config.boundaries), num_layers)
    if len(stored) != n:
        raise ForeignDataError(f"--boundaries {stored} names {len(stored)} states but sample {first.seq_id} "
                               f"stores {n} per token")
    last_index, absent = None, False
    if not separate and num_layers not in stored and config.no_last:
        absent = True
    elif not separate:
        if num_layers not in stored:
            raise NoLastStateError(stored, num_layers)
        if config.layout == "speculators" and stored[-1] != num_layers:
            raise ForeignDataError(f"--boundaries {stored}: speculators stores the verifier's last state last, "
                                   f"so the last boundary must be {num_layers}")
        last_index = stored.index(num_layers)
    default = [b for b in stored if b != num_layers]
    aux = validate_aux_boundaries(list(config.aux_boundaries or default), num_layers)
    if missing := [b for b in aux if b not in stored]:
        raise ForeignDataError(f"--aux-boundaries {aux}: {missing} are not stored (stored: {stored})")
    return Plan(stored=stored, aux_index=[stored.index(b) for b in aux], last_index=last_index, absent=absent,
                last_state=config.stored_last_state)


def shard_rows(sample: Sample, plan: Plan, hidden_size: int, scale: torch.Tensor | None
               ) -> tuple[torch.Tensor, ...] | Skip:
    """(input_ids [T], loss_mask [T], aux [T, k*H], last [T, H]) of one sample, or why it is skipped."""
    s, ids = sample.states, sample.input_ids
    want = [ids.shape[0], len(plan.stored), hidden_size]
    if ids.ndim != 1 or list(s.shape) != want or ids.shape[0] == 0:
        return Skip(sample.seq_id, "wrong shape",
                    f"hidden states {list(s.shape)} for {list(ids.shape)} token ids; expected {want}")
    if not s.is_floating_point() or ids.is_floating_point():
        return Skip(sample.seq_id, "wrong dtype", f"hidden states {s.dtype}, token ids {ids.dtype}")
    mask = sample.loss_mask if sample.loss_mask is not None else torch.ones_like(ids)
    if mask.shape != ids.shape or not ((mask == 0) | (mask == 1)).all():
        return Skip(sample.seq_id, "bad loss mask", f"loss mask {list(mask.shape)} {mask.dtype} for "
                    f"{ids.shape[0]} tokens; expected 0/1 per token")
    if plan.absent:
        last = torch.zeros(ids.shape[0], hidden_size)  # [T, H] no signal: doctor --labels tokens only
    elif sample.final_state is not None:
        if list(sample.final_state.shape) != [ids.shape[0], hidden_size]:
            return Skip(sample.seq_id, "wrong shape", f"hidden_state {list(sample.final_state.shape)}; "
                        f"expected [{ids.shape[0]}, {hidden_size}]")
        last = sample.final_state  # [T, H]
    else:
        last = s[:, plan.last_index]  # [T, H]
    if not plan.absent and plan.last_state == POST_NORM:
        if scale is None:
            raise ForeignDataError("--last-state post-norm (SpecForge's default): the stored boundary-L state is "
                                   "after the final norm; the import maps it back through the target's final norm "
                                   "weight, so --target must hold the weights (only the final norm, embedding and "
                                   "lm_head are read)")
        last = last.float() / scale  # [T, H]
    aux = s[:, plan.aux_index].reshape(ids.shape[0], -1)  # [T, k*H]
    bad = ~(torch.isfinite(aux).all(-1) & torch.isfinite(last).all(-1))  # [T]
    if bad.any():
        return Skip(sample.seq_id, "non-finite states", f"{int(bad.sum())} of {ids.shape[0]} tokens hold NaN/inf")
    return ids, mask, aux, last


def _read(config: ImportDataConfig, src: Path) -> Iterator[Sample | Skip]:
    tokens = Path(config.tokens) if config.tokens else None
    if config.layout == "vllm":
        return _with_rows(read_vllm(src), tokens) if tokens else read_vllm(src)
    if config.layout == "speculators":
        return read_speculators(src, tokens)
    if config.boundaries is None:
        raise ForeignDataError(f"SpecForge samples store their aux states concatenated, their layers not "
                               f"recorded: pass --boundaries ({BOUNDARY_HELP})")
    return read_specforge(src, len(config.boundaries))


def _with_rows(samples: Iterator[Sample | Skip], tokens: Path) -> Iterator[Sample | Skip]:
    """vLLM samples checked against jsonl rows (by id) and given their loss masks."""
    rows = {str(r.get("id")): r for r in read_rows(tokens)}
    for s in samples:
        if isinstance(s, Sample):
            row = rows.get(s.seq_id)
            if row is None:
                yield Skip(s.seq_id, "no row for these states", f"{tokens} has no row with id {s.seq_id!r}")
                continue
            if row["input_ids"] != s.input_ids.tolist():
                yield Skip(s.seq_id, "token ids differ from the rows' input_ids",
                           f"request {s.seq_id}: token_ids differ from row {s.seq_id!r} of {tokens}")
                continue
            s.loss_mask = torch.tensor(row["loss_mask"])
        yield s


def import_data(config: ImportDataConfig) -> ImportSummary:
    """Stream ``config.src`` into shards in ``config.out``; see the module docstring."""
    src, out = Path(config.src), Path(config.out)
    if not src.is_dir():
        raise FileNotFoundError(f"source {src} is not a directory of {config.layout} captures")
    # The lock sits beside OUT: OUT.partial, renamed into place under it, must not carry it along.
    with directory_lock(out.parent, what=f"--out {out}", name=f".{out.name}.lock"):
        if out.exists():
            raise ValueError(f"--out {out} already exists; an import writes a new shard directory, choose another")
        return _import(config, src, out, out.with_name(out.name + ".partial"))


def _import(config: ImportDataConfig, src: Path, out: Path, partial: Path) -> ImportSummary:
    fingerprint, scale, unknown, head_target = _target(config.target)
    if config.labels != "hidden" and head_target is None:
        raise ForeignDataError(f"--labels {config.labels} stores the target's top-K, computed by its head: --target "
                               f"{config.target} must hold the weights (only the embedding, final norm and lm_head "
                               "are read), or import with --labels hidden")
    first, samples = _peek(_read(config, src), boundary_match.SEQUENCES)
    plan = _plan(config, first, fingerprint, head_target) if first else None
    identified = _identify(config, plan.stored, first, fingerprint, head_target) if plan else None
    skipped: Counter[str] = Counter()
    writer: ShardWriter | None = None
    added = 0
    try:
        for item in samples:
            rows = item if isinstance(item, Skip) else shard_rows(item, plan, fingerprint.hidden_size, scale)
            if isinstance(rows, Skip):
                skipped[rows.reason] += 1
                log.warning("skipping %s: %s (%s)", rows.seq_id, rows.reason, rows.detail)
                continue
            if writer is None:
                writer = _writer(config, partial, plan, fingerprint, src, unknown, head_target)
            try:
                writer.add(item.seq_id, *rows)
                added += 1
            except (ShardError, ValueError) as e:
                skipped["rejected by the shard writer"] += 1
                log.warning("skipping %s: %s", item.seq_id, e)
        if added == 0:
            shutil.rmtree(partial, ignore_errors=True)
            reasons = ", ".join(f"{n} {why}" for why, n in skipped.items()) or "the source is empty"
            raise ForeignDataError(f"nothing imported from {src}: {reasons}")
        writer.source["skipped"] = dict(skipped)
        totals = writer.close()
    except BaseException:
        if writer is not None and partial.exists():
            writer.__exit__(Exception, None, None)  # keep the finished shards: a rerun resumes
        raise
    label_note = _check_labels(config, partial, out, head_target, plan)
    replace_dir(partial, out)
    notes = [f"fingerprint fields {unknown} are unknown (no weights/tokenizer in --target): train or doctor "
             f"with --allow-target-mismatch {','.join(unknown)}"] if unknown else []
    if identified:
        notes.append(identified)
    if plan.absent:
        notes.append(f"no boundary-L state: last_hidden is {ABSENT_LAST}; use doctor --stored --labels tokens")
    elif plan.last_state == POST_NORM:
        notes.append(f"last_hidden holds the {config.layout} capture's post-norm state mapped back through the final "
                     f"norm (--last-state post-norm{'' if config.last_state else ', the layout default'})")
    elif plan.last_index is None:
        notes.append(f"last_hidden holds the {config.layout} capture's final state as boundary L, as stored "
                     "(--last-state pre-norm)")
    if label_note:
        notes.append(label_note)
    return ImportSummary(out=out, contract=writer.contract, sequences=totals["sequences"], tokens=totals["tokens"],
                         skipped=dict(skipped), unknown=unknown, notes=notes)


def _last_hidden_record(layout: str, plan: Plan, num_layers: int) -> str:
    """The manifest's ``source.last_hidden``: where the shards' boundary-L state came from."""
    if plan.absent:
        return ABSENT_LAST
    if plan.last_state == POST_NORM:
        return f"{layout} post-norm state / norm(1) (head-equivalent to boundary L)"
    return f"stored boundary {num_layers}" if plan.last_index is not None else f"{layout} final state as boundary L"


def _writer(config: ImportDataConfig, partial: Path, plan: Plan, fingerprint: TargetFingerprint,
            src: Path, unknown: list[str], head_target: Target | None = None) -> ShardWriter:
    contract = HiddenStateContract(aux_boundaries=tuple(plan.stored[i] for i in plan.aux_index),
                                   target=fingerprint)
    storage = Storage(dtype=config.dtype, state_dtype=config.state_dtype, labels=config.labels)
    row_bytes = storage.token_bytes(contract)
    source: dict[str, Any] = {
        "imported_from": str(src.resolve()), "layout": config.layout, "stored_boundaries": plan.stored,
        "last_hidden": _last_hidden_record(config.layout, plan, fingerprint.num_layers),
        "target": config.target, "tokens": config.tokens, "fingerprint_unknown": unknown,
        "import_config": config_record(config)}  # rebuilds the import line (doctor: a re-import that fixes it)
    if not plan.absent:
        source["last_state"] = plan.last_state  # the label check reads it (label_check.stored_last_state)
    head = None if head_target is None else (lambda h: head_target.head(h.to(head_target.dtype)))  # [n, H] -> [n, V]
    return ShardWriter(partial, contract, source=source, dtype=config.dtype,
                       shard_tokens=max(1, config.shard_mb * 2**20 // row_bytes),
                       state_dtype=config.state_dtype, labels=config.labels, labels_head=head)



def _check_labels(config: ImportDataConfig, partial: Path, out: Path, head: Target | None, plan: Plan) -> str | None:
    """The label check on ``partial`` before it becomes ``out`` (``label_check.py``); a note when not run.
    A fail keeps ``partial`` (every sample is written there) and says what to do."""
    if plan.absent:
        return None  # no boundary-L state to check (--no-last)
    if config.skip_label_check:
        return "label check skipped (--skip-label-check)"
    if head is None:
        return ("label check not run: --target holds no weights (its final norm and lm_head judge the stored "
                "last state); `eaglewire doctor --stored` with the weights runs it")
    check = check_labels(ShardDataset(partial, verify=False), head, greedy=False, reference=False)
    log.info("label check (%s): %s", check.rule, check.message)
    if check.verdict == "fail":
        error = LabelCheckError(check, f"import-data --boundaries {','.join(map(str, plan.stored))} "
                                       f"--last-state {plan.last_state}")
        fix = reimport_fix(check.diagnosis, head.num_layers)
        if not check.norm_side_wrong and plan.last_index is None:  # SpecForge: --boundaries names the aux only
            fix = f"once the capture's final hidden_state is boundary {head.num_layers} (capture it again)"
        error.add_note(f"nothing was renamed to {out}: the imported shards are kept in {partial} to inspect. Delete "
                       f"{partial} and import again {fix}" + ("" if check.norm_side_wrong else f"; {SKIP_HINT}"))
        raise error
    return None if check.verdict == "ok" else f"label check: {check.message}"


# ------------------------------------------------------------------ which boundary each stored state is

class BoundaryMismatchError(ForeignDataError):
    """``--boundaries`` name other layers than the stored states are (``boundary_match.py``); nothing is written."""

    def __init__(self, message: str, identification: boundary_match.Identification, command: str | None):
        super().__init__(message)
        self.identification, self.command = identification, command


def _peek(items: Iterator[Sample | Skip], n: int) -> tuple[list[Sample], Iterator[Sample | Skip]]:
    """(the first ``n`` samples, every item as if none were read)."""
    items, held = iter(items), []
    for item in items:
        held.append(item)
        if sum(isinstance(x, Sample) for x in held) == n:
            break
    return [x for x in held if isinstance(x, Sample)], itertools.chain(held, items)


def _weight_bytes(spec: str) -> int:
    return sum(p.stat().st_size for p in set(tensor_locations(resolve_target_path(spec)).values()))


def _full_target(config: ImportDataConfig, head: Target | None) -> tuple[Target | None, str | None]:
    """(the whole target to run, or None and why it is not loaded)."""
    later = ("`eaglewire doctor --draft DRAFT --target TARGET --data OUT` (not --stored) matches the stored states "
             "against the target where it runs")
    if head is None and config.identify_boundaries == "yes":
        raise ForeignDataError(f"--identify-boundaries yes runs the target on the first samples' tokens: --target "
                               f"{config.target} holds no weights; pass a model directory with them")
    if head is None:
        return None, ("boundaries not identified: --target holds no weights, and telling which boundary each stored "
                      f"state is runs the target on the first samples' tokens; {later}")
    size = _weight_bytes(config.target)
    if config.identify_boundaries == "auto" and size > IDENTIFY_MAX_BYTES:
        return None, (f"boundaries not identified: the target's weights are {size / 2**30:.1f} GiB, loaded only when "
                      f"asked: import with --identify-boundaries yes (the whole target runs on "
                      f"{boundary_match.SEQUENCES} samples' tokens), or {later}")
    log.info("loading target %s (%.1f GiB) to identify the stored states' boundaries", config.target, size / 2**30)
    return load_target(config.target), None


def _plan(config: ImportDataConfig, first: list[Sample], fingerprint: TargetFingerprint, head: Target | None
          ) -> Plan:
    """``make_plan``; where ``--boundaries`` name no boundary L, the stored states are identified first, so a slot
    that is boundary L said to be another is named with the import line that takes it as L."""
    try:
        return make_plan(config, first[0], fingerprint.num_layers)
    except NoLastStateError as e:
        _identify(config, e.stored, first, fingerprint, head)  # raises BoundaryMismatchError on a misread slot
        raise


def _identify(config: ImportDataConfig, stored: list[int], first: list[Sample], fingerprint: TargetFingerprint,
              head: Target | None) -> str | None:
    """The first samples' stored states (``stored``: the boundary --boundaries says each is) against every boundary
    of the target run on their tokens: raises ``BoundaryMismatchError`` where ``--boundaries`` name other layers;
    else a note for the summary."""
    if config.identify_boundaries == "no":
        return None
    L, H, n = fingerprint.num_layers, fingerprint.hidden_size, len(stored)
    # a post-norm boundary-L slot is no boundary (the label check judges it); SpecForge's is not among the slots
    slots = [j for j, b in enumerate(stored) if not (b == L and config.stored_last_state == POST_NORM)]
    usable = [s for s in first if s.input_ids.ndim == 1 and list(s.states.shape) == [len(s.input_ids), n, H]
              and len(s.input_ids) and bool(torch.isfinite(s.states.float()).all())
              and 0 <= int(s.input_ids.min()) and int(s.input_ids.max()) < fingerprint.vocab_size]
    if not slots or not usable:
        return None
    target, why = _full_target(config, head)
    if target is None:
        return why
    found = boundary_match.identify(target, [(s.input_ids.tolist(), s.states[:, slots]) for s in usable],
                                    [stored[j] for j in slots], slots=slots)
    del target
    if found.ok:
        if found.unmatched():
            return ("boundaries not confirmed: some stored states are no boundary of the target run here (another "
                    f"precision or quantization, or another target) ({found.what()}): " + "; ".join(found.lines()))
        worst = max(c.own for c in found.checks)
        return (f"each stored state is the boundary --boundaries names: matched against every boundary of the target "
                f"run on {found.what()} (largest relative error {worst:.1e})")
    corrected = found.corrected()
    boundaries = boundary_match.fix_boundaries(stored, corrected)
    aux = boundary_match.fix_boundaries(config.aux_boundaries, corrected) if config.aux_boundaries else None
    said = ",".join(map(str, stored))
    message = (f"--boundaries {said} name other layers than the stored states are: each stored state of the first "
               f"samples was matched against every boundary of {config.target} run on their tokens ({found.what()}): "
               + "; ".join(found.lines("--boundaries says")) + ". ")
    if cause := found.cause():
        message += cause[0].upper() + cause[1:] + ". "
    if boundaries is None or (config.aux_boundaries and aux is None):
        raise BoundaryMismatchError(message + "Two stored states are one boundary, so no --boundaries describes "
                                    "this capture: check which layers it captured. Nothing was imported", found, None)
    # --no-last stands only while no stored state is boundary L
    changes = dict(boundaries=boundaries, aux_boundaries=aux, no_last=config.no_last and L not in boundaries)
    try:  # the boundaries the states are must make an import too (a capture whose boundary-L slot is another layer)
        make_plan(dataclasses.replace(config, **changes), first[0], L)
    except ForeignDataError as e:
        raise BoundaryMismatchError(message + f"Nothing was imported, and as the boundaries they are "
                                    f"({','.join(map(str, boundaries))}) they do not import either: {e}", found,
                                    None) from None
    command = import_command(config, **changes)
    raise BoundaryMismatchError(message + "Nothing was imported; import them as the boundaries they are:\n  "
                                + command, found, command)


def import_command(config: ImportDataConfig, **changes: Any) -> str:
    """The ``eaglewire import-data`` line of ``config`` with ``changes``: the source, then each setting that is
    required or differs from its default."""
    config = dataclasses.replace(config, **changes)
    words = ["eaglewire", "import-data", config.src]
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.metadata.get("positional") or value is False or (f.default is not dataclasses.MISSING
                                                              and value == f.default):
            continue
        words.append("--" + f.metadata.get("flag", f.name).replace("_", "-"))
        if value is not True:
            words.append(",".join(map(str, value)) if isinstance(value, list) else str(value))
    return shlex.join(words)


def reimport_command(source: dict[str, Any], corrected: dict[int, int], out: str) -> str | None:
    """The import line that rebuilds shards whose manifest ``source`` records an import, into ``out``, with each
    misread boundary (``corrected``: said -> is) replaced; None when the source records no import, or when no
    --boundaries describes the capture (two stored states one boundary)."""
    if not source.get("imported_from") or not source.get("stored_boundaries"):
        return None
    record = source.get("import_config") or {
        "src": source["imported_from"], "layout": source.get("layout"), "target": source.get("target"),
        "tokens": source.get("tokens"), "last_state": source.get("last_state")}
    known = {f.name for f in dataclasses.fields(ImportDataConfig)}
    config = ImportDataConfig(**{k: v for k, v in record.items() if k in known} | {"out": out})
    boundaries = boundary_match.fix_boundaries(list(source["stored_boundaries"]), corrected)
    aux = boundary_match.fix_boundaries(config.aux_boundaries, corrected) if config.aux_boundaries else None
    if boundaries is None or (config.aux_boundaries and aux is None):
        return None
    return import_command(config, boundaries=boundaries, aux_boundaries=aux, identify_boundaries="auto")
