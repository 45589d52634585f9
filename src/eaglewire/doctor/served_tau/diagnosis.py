"""``doctor --engine-url``, when the server accepts less than the replay: which wiring it feeds the draft.

Greedy decoding is lossless, so a server accepts exactly what the draft accepts on the server's own
text *as that server runs it*. The doctor already holds that text; it replays the draft along it
under every wiring it knows an engine may run instead of the trained one, and names the one whose
per-position acceptance is the server's:

- layouts: ``layouts.candidate_layouts`` (what the engine reads from ``--engine-config``, each
  boundary off by one, all of them off by one, the first/last k of k+1 captured states: the
  embedding output or the last state swapped in) and the last state after the target's final norm
  where a layout feeds boundary L;
- the declared states concatenated in another order (``order_wirings``: a served fc whose columns take them
  otherwise);
- field readings (EAGLE-3): each norm flag the serving engine reads (``served_draft.TRAINED_NORMS``,
  built by ``served_draft.as_served``; ``norm_output`` here), d2t read in the other convention, missing or
  another draft vocabulary's, the target's lm_head over its whole vocabulary, another embedding than the
  target's (its rows permuted, several seeded ways: ``STAND_INS``), another lm_head than the draft's (its rows
  permuted so), and the engine's own reading of ``--engine-config`` (``engine_reading.read_fields`` /
  ``read_file_fields``) with each of its layouts.

Where several with different fixes fit, ``probes.separate`` asks the server more, on prompts chosen by replay.

``--engine-config`` ranks the candidates (what the engine reads from it comes first among equally good
matches) and never removes one: the server may load another copy than the user's. Every fix is proven
before it is printed (``fix_proof.prove``): a fix for what the user's config already holds as trained
changes nothing there, so the server runs another copy, and that is what is printed; a fix that writes
config keys is applied to the parsed config and read again through the engine's reading.

A wiring matches when each position's acceptance and τ replayed under it agree with the server's
counters within binomial noise over the server's drafts (``fit``). The pure part (``fit``,
``judge``, ``diagnosis_check``) takes replayed counts; ``diagnose`` captures the text once at every
boundary any candidate reads and replays each candidate on it (a draft unroll per candidate: cheap).

Shapes: S draft steps, T tokens, H hidden size, V target vocabulary.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import time
import types
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from eaglewire import engines
from eaglewire.core.contract import default_aux_boundaries
from eaglewire.doctor.evidence import MIN_LEAD, Z
from eaglewire.doctor.served_tau.fix_proof import (HEAD_ROWS, LAYOUT, ConfigView, absent_tensors, held_fields, holds_trained_head,
                                        prove)
from eaglewire.doctor.layouts import candidate_layouts
from eaglewire.doctor.served_tau.probes import Probed, Prober, separate
from eaglewire.doctor.served_tau.wiring_fit import (POST_NORM, Fit, Wiring, by_candidate, capture_texts, fit,  # noqa: F401
                                         judge, rate_noise, replay_wiring, still_fitting, tau_noise)  # (re-exported)
from eaglewire.doctor.verdicts import Check
from eaglewire.engines.serving.served_counts import AcceptanceRates

log = logging.getLogger(__name__)

DEFAULT_LAYERS = "default layers"  # the candidate of an engine that finds no ids in its config
SHOWN = 6  # candidates listed in the evidence, closest first
# Another model's rows (an embedding, an lm_head, a d2t from another draft) are replayed as this many seeded
# permutations, each a candidate with the same label and fix (``Wiring.stand_in``): what the draft accepts under
# unrelated rows depends on which rows they are, and the served copy holds none of the doctor's, so each is judged
# with the family's spread on the same text (``wiring_fit.family_spread``). Without it, a real vLLM serving another
# permutation fell outside noise of all three, and a wrong layout that happened to fit was named.
STAND_INS = 3

# The norm flags an engine reads from a draft's config (a server can only compute with those) and how it reads
# d2t are its linter's (``Linter.norm_flags`` / ``d2t_reading``); eaglewire's server runs the draft as trained.


# ---------------------------------------------------------------- candidates


def show_layout(layout, num_layers: int) -> str:
    return "[" + ", ".join(f"{num_layers} post-norm" if b == POST_NORM else str(b) for b in layout) + "]"


def _reason(label: str) -> str:
    """layouts.candidate_layouts' reason, as the diagnosis says it."""
    if label == f"served by {DEFAULT_LAYERS}":
        return "the engine's default layers, what it feeds where its config holds no ids"
    if label.startswith("served by "):
        return f"what {label.removeprefix('served by ')} reads from its config"
    if label.startswith("boundary "):
        a, b = label.removeprefix("boundary ").split(" -> ")
        return f"boundary {a} read as {b}"
    if label in ("all -1", "all +1"):
        return f"every boundary one layer {'earlier' if label == 'all -1' else 'later'}: ids in another convention"
    if label.startswith(("first ", "last ")):
        end, k, _, union = label.split(" ", 3)
        return f"the {end} {k} of {len(json.loads(union))} states captured, {union}"
    return label


def layout_wirings(declared: list[int], num_layers: int, readings: dict[str, list[int]], fix: str | None,
                   *, post_norm: bool = True) -> list[Wiring]:
    """Every layout but the declared one the sweep knows (``candidate_layouts``; ``readings``: label -> the
    boundaries the engine reads from its config), and each of those that feeds boundary L (the declared
    first) with L's state taken after the final norm."""
    out = []
    readings = dict(readings)
    try:
        readings.setdefault(DEFAULT_LAYERS, default_aux_boundaries(num_layers))
    except ValueError:
        pass
    layouts = candidate_layouts(declared, num_layers, readings)
    for layout, why in layouts.items():
        if list(layout) != declared and len(layout) == len(declared):
            shown = show_layout(layout, num_layers)
            read = [w for w in why if w.startswith("served by") and DEFAULT_LAYERS not in w]
            reasons = "; ".join(map(_reason, read or why))
            out.append(Wiring(tuple(layout), shown, f"feeds boundaries {shown} ({reasons})", f"on {declared}", fix,
                              from_config=bool(read), aspect=LAYOUT))
    if post_norm:
        for layout, why in layouts.items():
            if num_layers in layout and (list(layout) == declared or any(w.startswith("served by") for w in why
                                                                         if DEFAULT_LAYERS not in w)):
                normed = tuple(POST_NORM if b == num_layers else b for b in layout)
                shown = show_layout(normed, num_layers)
                out.append(Wiring(normed, shown, f"feeds boundaries {shown} (boundary {num_layers} after the "
                                  "target's final norm, as transformers' hidden_states[-1] holds it)",
                                  f"on {declared} (boundary {num_layers} before the final norm)", fix))
    return out


def order_wirings(engine: str, declared: list[int], num_layers: int) -> list[Wiring]:
    """The declared states concatenated in another order (a served fc whose columns take them in another order
    than the engine feeds them): every non-identity permutation of up to 3 states, else the reversed order and
    each swap. The same capture serves them all."""
    k = len(declared)
    if k <= 3:
        orders = list(itertools.permutations(range(k)))
    else:
        swaps = [[j if j not in (a, b) else a + b - j for j in range(k)] for a, b in itertools.combinations(range(k), 2)]
        orders = [tuple(reversed(range(k)))] + [tuple(s) for s in swaps]
    spec = engines.get(engine) if engine in engines.names() else None
    fix = ((spec.linter.field_fix if spec is not None and spec.linter.field_fix else None) or
           f"the served copy's fc.weight takes the states in another order than {engine} concatenates them "
           f"(boundaries {declared}, ascending): serve the checkpoint `eaglewire export --to {engine}` writes")
    out = []
    for order in dict.fromkeys(orders):
        if list(order) != list(range(k)):
            layout = tuple(declared[i] for i in order)
            shown = show_layout(layout, num_layers)
            out.append(Wiring(layout, f"order {shown}", f"concatenates the states in the order {shown} (fc's "
                              f"columns in another order than the states fed)", f"on {declared} in that order", fix))
    return out


def _served_mismatch(engine: str, cfg, **served):
    """``served_draft.mismatches`` of a draft as ``engine`` would read it with ``served`` changed (its one
    field read otherwise, with the meaning and the fix the engines' readings give it)."""
    from eaglewire.engines.serving.served_draft import ServedDraft, mismatches

    base = dict(engine=engine, norms={}, draft_vocab_size=cfg.draft_vocab_size,
                target_hidden_size=cfg.target_hidden_size, num_aux=cfg.num_aux, hidden_size=cfg.hidden_size,
                head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                rope_parameters=dict(cfg.rope_parameters or {}), embedding="target", lm_head="draft")
    found = mismatches(ServedDraft(**(base | served)), cfg)
    return found[0] if found else None


def feeds_post_norm_state(draft):
    """A copy of ``draft`` that feeds each step the previous step's post-norm state (``norm_output``:
    the residual and the next step read norm(h) instead of h; the logits are the same)."""
    served = copy.deepcopy(draft)
    step = served.forward_ttt

    def forward_ttt(self, emb, hidden, position_ids, cache):
        return step(emb, self.norm(hidden) if cache else hidden, position_ids, cache)  # cache: an earlier step ran

    served.forward_ttt = types.MethodType(forward_ttt, served)
    return served


def field_wirings(engine: str, draft, target, declared: list[int]) -> list[Wiring]:
    """The field readings ``engine`` may compute the draft with other than trained, each at the declared
    layout: its norm flags, d2t in the other convention, missing or another vocabulary's, the target's lm_head."""
    from eaglewire import engines
    from eaglewire.engines.serving.served_draft import TRAINED_NORMS, as_served

    cfg = draft.config
    spec = engines.get(engine) if engine in engines.names() else None
    lint = spec.linter if spec is not None else None
    name = engine if spec is not None else "the engine"
    layout, out = tuple(declared), []
    refix = lint.field_fix if lint is not None else None  # a fix that replaces every field's (llama.cpp: re-export)
    if spec is not None and spec.in_process:
        return out  # it runs the draft directory as trained
    for flag in (lint.norm_flags if lint is not None else tuple(TRAINED_NORMS)):
        m = _served_mismatch(name, cfg, norms={flag: True})
        fix = refix or (m.fix.replace("config.json", "the draft's config.json") if m else None)
        build = ((lambda: (feeds_post_norm_state(draft), None)) if flag == "norm_output" else
                 (lambda m=m: (as_served(draft, [replace(m, measurable=True)]), None)))
        out.append(Wiring(layout, f"{flag} true", f"reads {flag} as true ({TRAINED_NORMS[flag]})", "without it",
                          fix, build=build, aspect=flag))
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    trained = draft.draft_to_target.cpu()  # [Vd]
    offsets = draft.d2t.cpu().long()  # [Vd]
    reading = lint.d2t_reading if lint is not None else None
    variants = []
    if bool(offsets.any()):  # a pruned vocabulary: the map matters
        variants.append(("no d2t: draft id i read as target id i", torch.arange(Vd),
                         refix or "write the draft's d2t (offsets: target id - draft id) "
                         "beside the weights, or re-export with `eaglewire export`"))
        if reading in ("ids", None):
            variants.append(("d2t's offsets read as absolute target ids", offsets,
                             refix or "write d2t as absolute target ids, or re-export"))
        if reading in ("offsets", None):
            variants.append(("d2t written as absolute target ids, read as offsets", torch.arange(Vd) + trained,
                             "rewrite d2t as d2t - arange(draft_vocab_size) (offsets), or re-export with "
                             "`eaglewire export`"))
        variants += [("another vocabulary's d2t: the draft's ids mapped onto another selection of target ids",
                      other_vocabulary(V, Vd, seed), refix or "the served copy's d2t is not the draft's: write the "
                      "draft's own d2t back (re-export with `eaglewire export`)") for seed in range(STAND_INS)]
    seen = [trained]
    for what, mapped, fix in variants:
        if int(mapped.min()) >= 0 and int(mapped.max()) < V and not any(torch.equal(mapped, m) for m in seen):
            seen.append(mapped)
            out.append(Wiring(layout, what.split(":")[0], f"maps the draft's ids with {what}",
                              "with d2t as offsets (target id = draft id + d2t)", fix, aspect="d2t",
                              stand_in=what.startswith("another vocabulary"),
                              build=lambda mapped=mapped: (as_served(draft, [], d2t=mapped - torch.arange(Vd)), None)))
    head = target.model.get_output_embeddings().weight
    if tuple(head.shape) == (V, cfg.hidden_size):
        m = _served_mismatch(name, cfg, lm_head="target")
        fix = (refix or
               f"{m.fix} in the draft's config.json, and keep the trained lm_head.weight in its checkpoint (re-export "
               "with `eaglewire export`)" if m else None)
        out.append(Wiring(layout, "the target's lm_head", "scores the draft's tokens with the target's lm_head over "
                          f"its whole vocabulary ({V:,} ids)", f"with its own lm_head over {Vd:,} draft ids", fix,
                          aspect="lm_head", build=lambda: target_head_draft(draft, target)))
    embedding = ("another embedding", "embeds the tokens with rows other than the target's (replayed with the "
                 "target's rows permuted, several ways)", "with the target's embed_tokens", refix or
                 "the served copy's embed_tokens is not the target's: remove embed_tokens.weight from the served "
                 "draft checkpoint or write the target's rows there (re-export with `eaglewire export`)",
                 "embed_tokens", lambda seed: (draft, other_embedding(target, seed)))
    head = ("another lm_head", "scores the draft's tokens with lm_head rows other than its own (replayed with its rows "
            "permuted, several ways: the draft's ids mean other tokens)", "with its own lm_head", refix or
            "the served copy's lm_head.weight is not the trained one: write the draft's own lm_head.weight back "
            "(re-export with `eaglewire export`)", HEAD_ROWS, lambda seed: (other_head(draft, seed), None))
    embeds = lint is None or lint.draft_embedding  # an engine that always embeds with the target's rows: none
    return out + row_stand_ins(layout, [embedding, head] if embeds else [head])


def row_stand_ins(layout: tuple[int, ...], families: list[tuple]) -> list[Wiring]:
    """Each family of another model's rows, (label, what, trained, fix, aspect, build(seed)), as STAND_INS seeded
    stand-ins (see STAND_INS), seed by seed."""
    return [Wiring(layout, label, what, trained, fix, aspect=aspect, stand_in=True,
                   build=lambda build=build, seed=seed: build(seed))
            for seed in range(STAND_INS) for label, what, trained, fix, aspect, build in families]


def block_field_wirings(engine: str, draft, target, declared: list[int]) -> list[Wiring]:
    """A DFlash draft's rows a served copy may hold otherwise, each at the declared layout and replayed as
    STAND_INS seeded stand-ins: the draft embeds its block (the anchor and the mask token) and scores it with the
    target's rows unless the checkpoint ships its own, which vLLM loads where present (qwen3_dflash.py
    load_weights: ``embed_tokens`` into the model, ``lm_head`` as is; the mask slot reads
    embed_tokens[mask_token_id])."""
    from eaglewire import engines

    spec = engines.get(engine) if engine in engines.names() else None
    lint = spec.linter if spec is not None else None
    if spec is not None and spec.in_process:
        return []  # it runs the draft directory as trained
    refix = lint.field_fix if lint is not None else None
    embedding = ("another embedding", "embeds the block (its anchor and mask tokens) with rows other than the "
                 "target's (replayed with the target's rows permuted, several ways)", "with the target's embed_tokens",
                 refix or "the served copy's embed_tokens is not the target's: remove embed_tokens.weight from the "
                 "served draft checkpoint (the engine then shares the target's; re-export with `eaglewire export`)",
                 "embed_tokens", lambda seed: (draft, other_block_embedding(target, draft, seed)))
    head = ("another lm_head", "scores the block with lm_head rows other than the target's (replayed with them "
            "permuted, several ways: the draft's ids mean other tokens)", "with the target's lm_head", refix or
            "the served copy's lm_head.weight is not the target's: remove it from the served draft checkpoint (the "
            "engine then shares the target's; re-export with `eaglewire export`)", "lm_head",
            lambda seed: (draft, other_block_head(draft, seed)))
    embeds = lint is None or lint.draft_embedding
    return row_stand_ins(tuple(declared), [embedding, head] if embeds else [head])


def other_block_embedding(target, draft, seed: int = 0) -> Callable:
    """The batch transform that feeds a DFlash draft another embedding than the target's: the text's and the mask
    token's rows both read under a seeded permutation of the vocabulary, as a served copy's own embed_tokens is."""
    from eaglewire.model.dflash_blocks import mask_embedding

    perm = _permutation(target.embed_tokens.weight.shape[0], seed).to(target.device)  # [V]
    text = other_embedding(target, seed)
    mask = mask_embedding(draft, lambda ids: target.embed_tokens(perm[ids]), target.device)  # [H]

    def fed(batch):
        return replace(text(batch), mask_emb=mask.to(batch.mask_emb.device, batch.mask_emb.dtype))

    return fed


def other_block_head(draft, seed: int = 0) -> Callable:
    """The batch transform that scores a DFlash draft's block with permuted head rows (seeded): logit i is the
    trained head's logit of another id, as a served copy's foreign lm_head.weight gives it."""
    perm = _permutation(draft.config.draft_vocab_size, seed)  # [Vd] the head's rows (Vd = V: the whole head)

    def fed(batch):
        head = batch.lm_head

        def scored(hidden):  # [N, H] -> [N, Vd]: column i the trained head's logit of id perm[i]
            return head(hidden)[:, perm.to(hidden.device)]

        return replace(batch, lm_head=scored)

    return fed


def _permutation(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))  # [n]


def other_vocabulary(V: int, Vd: int, seed: int = 0) -> torch.Tensor:
    """Draft id -> target id of another draft vocabulary of ``Vd`` ids out of ``V`` (seeded, ascending as a
    frequency selection's d2t is): the map a served copy holds when its d2t came from another draft."""
    return _permutation(V, seed)[:Vd].sort().values  # [Vd]


def other_embedding(target, seed: int = 0) -> Callable:
    """The batch transform that feeds the draft another embedding than the target's: the target's rows under a
    seeded permutation of the vocabulary (to the draft, any unrelated model's rows look alike)."""
    perm = _permutation(target.embed_tokens.weight.shape[0], seed).to(target.device)  # [V]

    def fed(batch):
        with torch.no_grad():
            emb = target.embed_tokens(perm[batch.input_ids.to(target.device)])  # [B, T, H]
        return replace(batch, emb=emb.to(batch.emb.device, batch.emb.dtype))

    return fed


def other_head(draft, seed: int = 0):
    """A copy of ``draft`` whose lm_head rows are permuted (seeded): draft id i scored with another id's row."""
    from eaglewire.engines.serving.served_draft import as_served

    rows = draft.lm_head.weight.detach()  # [Vd, H]
    return as_served(draft, [], lm_head=rows[_permutation(rows.shape[0], seed).to(rows.device)])


def target_head_draft(draft, target):
    """(``draft`` scoring with the target's lm_head over the whole vocabulary, the batch transform that
    judges it there: the target's signal over every id)."""
    from eaglewire.model.draft import Eagle3Draft
    from eaglewire.model.ttt import signal_positions, target_signal

    V = draft.config.vocab_size
    full = Eagle3Draft(replace(draft.config, draft_vocab_size=V))
    keep = {k: v for k, v in draft.state_dict().items() if not k.startswith("lm_head.") and k not in ("d2t", "t2d")}
    full.load_state_dict(keep, strict=False)
    with torch.no_grad():
        full.lm_head.weight.copy_(target.model.get_output_embeddings().weight.float())  # [V, H]
    full.set_vocab(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    full = full.to(draft.fc.weight.device, draft.fc.weight.dtype).eval()
    L = target.num_layers
    ids = torch.arange(V, device=target.device)
    every = torch.ones(V, dtype=torch.bool, device=target.device)

    def judged_over_every_id(batch):
        last = batch.states[L].to(target.device, target.dtype)  # [B, T, H]
        return replace(batch, signal=target_signal(target.head, last, ids, every,
                                                   needed=signal_positions(batch.loss_mask.to(target.device))))

    return full, judged_over_every_id


def config_wirings(engine: str, engine_config: str | None, draft, declared: list[int], num_layers: int,
                   arch: str | None, emb_rows, layout_fix: str | None, dflash: bool
                   ) -> tuple[dict[str, list[int]], list[Wiring], list[str], ConfigView | None]:
    """What ``engine`` reads from ``engine_config`` (``--engine-config``): (label -> the boundaries it feeds, the
    wirings of its field reading at each of its layouts, notes, the config as the fixes are proven on). Nothing
    without an engine config."""
    from eaglewire import engines
    from eaglewire.core.errors import read_json_object
    from eaglewire.doctor import engine_reading
    from eaglewire.engines import canonical
    from eaglewire.engines.serving.served_draft import as_served

    if not engine_config:
        return {}, [], [], None
    path, engine = Path(engine_config), canonical(engine)
    readings: dict[str, list[int]] = {}
    cfg = None
    try:
        readers = engines.file_readers(path.suffix)
        if readers:  # a draft file of the engine's own (a .gguf): its layers and fields as that engine reads them
            own = readers[0]
            layers = own.linter.draft_file_layers(path)
            if layers and all(0 <= b <= num_layers for b in layers) and len(set(layers)) == len(layers):
                readings = {own.runtime.label if own.runtime else own.name: list(layers)}
            reading = None if dflash else engine_reading.read_file_fields(path, draft, emb_rows=emb_rows)
        else:
            cfg = read_json_object(path, "pass --engine-config the draft's config.json")
            reader = engine_reading.read_dflash_engine_config if dflash else engine_reading.read_engine_config
            readings = dict(reader(engine, cfg, num_layers, declared, arch).readings)
            reading = (engine_reading.read_fields(engine, cfg, path.parent, draft, emb_rows=emb_rows)
                       if not dflash and engine in engine_reading.field_readers() else None)
    except Exception as e:  # the engine checks said what is wrong with it; the diagnosis goes on without it
        return readings, [], [f"--engine-config {path} not read as the engine reads it: {e}"], None

    def aspects(got: dict[str, list[int]], fields) -> tuple[set[str], set[str]]:
        found = None if fields is None else _field_names(fields.found)
        held = held_fields(got, declared, found, FIELD_ASPECTS)
        return held, ({LAYOUT} - held) | set(found or ())

    def reread(edited: dict) -> tuple[set[str], set[str]]:
        reader = engine_reading.read_dflash_engine_config if dflash else engine_reading.read_engine_config
        fields = (engine_reading.read_fields(engine, edited, path.parent, draft, emb_rows=emb_rows)
                  if reading is not None else None)
        return aspects(dict(reader(engine, edited, num_layers, declared, arch).readings), fields)

    held, differs = aspects(readings, reading)
    if cfg is not None and not dflash and holds_trained_head(path.parent, draft):  # no config field shows the rows
        held.add(HEAD_ROWS)
    if cfg is not None and dflash:  # a tensor the copy does not ship is the target's: the draft was trained so
        absent = absent_tensors(path.parent, ("embed_tokens.weight", "lm_head.weight"))
        held |= {name.split(".")[0] for name in absent}
    view = ConfigView(str(path), cfg, held, differs, reread if cfg is not None else None)
    if reading is None or not reading.found or not all(f.measurable for f in reading.found):
        return readings, [], [], view
    names = ", ".join(f.field for f in reading.found)
    fields_fix = "; ".join(dict.fromkeys(f.fix for f in reading.found))

    def build():
        from eaglewire.doctor.checks import served_embedding

        built = as_served(draft, reading.found, d2t=reading.d2t, norm_weights=reading.norm_weights,
                          lm_head=reading.lm_head)
        return built, (None if reading.embedding is None else lambda b: served_embedding(b, reading.embedding))

    out = []
    for label, layout in {"as trained": declared, **readings}.items():
        if label != "as trained" and list(layout) == declared:
            continue
        where = "" if list(layout) == declared else f" and feeds boundaries {layout} ({_reason('served by ' + label)})"
        fix = fields_fix if list(layout) == declared else f"{layout_fix}; {fields_fix}"
        shown = f"{reading.served.engine}'s reading of --engine-config" + ("" if where == "" else f" at {layout}")
        out.append(Wiring(tuple(layout), shown, f"reads {names} from its config as {reading.served.engine} does "
                          f"(" + "; ".join(f.meaning for f in reading.found) + ")" + where,
                          f"on {declared} with {names} as trained", fix, from_config=True, build=build))
    return readings, out, [], view


# the config fields a wiring may read otherwise (its aspect), besides the layout
FIELD_ASPECTS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "d2t", "embed_tokens", "lm_head")


def _field_names(found) -> set[str]:
    """The aspects the fields ``found`` (served_draft.Mismatch) read otherwise: a missing draft_vocab_size or a
    tied head is the target's lm_head."""
    names = {m.field for m in found}
    return names | ({"lm_head"} if "draft_vocab_size" in names else set())


# ---------------------------------------------------------------- matching


def _rates(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def _span(values: list[float]) -> str:
    """A figure of several stand-ins as min..max (one value where they agree to the shown digits)."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return low if low == high else f"{low}..{high}"


def _row(fits: list[Fit]) -> str:
    """One candidate's line (``by_candidate``): its replay per position and τ (a family of stand-ins: the spread of
    theirs) and how far from the server its closest fit is."""
    f = fits[0]
    rates = "/".join(_span([g.per_position[i] for g in fits]) for i in range(len(f.per_position)))
    label = f.wiring.label + (f" ({len(fits)} stand-ins)" if len(fits) > 1 else "")
    verdict = "within noise" if f.matches else f"{f.score:.1f}x the noise away"
    return f"{label}: {rates + ', ' if rates else ''}τ {_span([g.replayed.tau for g in fits])}: {verdict}"


def _candidate_record(fits: list[Fit]) -> dict:
    """One candidate in the JSON report: its closest fit, and a family's spread over its stand-ins."""
    f = fits[0]
    out = {"label": f.wiring.label, "layout": list(f.wiring.layout), "tau": f.replayed.tau,
           "per_position": f.per_position, "score": round(f.score, 2)}
    if len(fits) > 1:
        out["stand_ins"] = {"count": len(fits), "tau": [min(g.replayed.tau for g in fits),
                                                        max(g.replayed.tau for g in fits)],
                            "per_position": [[min(r), max(r)] for r in zip(*(g.per_position for g in fits))]}
    return out


def diagnosis_check(served: AcceptanceRates, engine: str, declared: list[int], trained: AcceptanceRates,
                    best: Fit | None, ranked: list[Fit], causes: list[str], *, seconds: float = 0.0,
                    tokens: int = 0, probed: Probed | None = None) -> Check:
    """The served-wiring Check: the wiring whose replay is the server's acceptance (``best``, with the config
    line that restores training's), or none, saying so and what else remains (``causes``); ``probed``: the probe
    prompts sent to separate the wirings the first answers could not (their drafts are in ``served``)."""
    name = "served wiring"
    n = served.drafts
    as_trained = fit(served, Wiring(tuple(declared), f"as trained {declared}", "", ""), trained)
    evidence = [f"{len(ranked)} wirings replayed on the server's own {tokens:,} output tokens in {seconds:.1f} s; "
                f"noise: {Z:g} binomial standard errors of each position's rate over the server's {n:,} drafts, "
                f"at least {MIN_LEAD}; of τ, {Z:g} standard errors of the tokens accepted per draft",
                *([f"probes (the wirings within noise of the first answers, replayed on prompts chosen to separate "
                   f"them): {probed.said()}"] if probed else []),
                f"served: {_rates(as_trained.served_per_position) or '-'} per position, τ {served.tau:.2f}",
                _row([as_trained])]
    evidence += [_row(c) for c in by_candidate(ranked)[:SHOWN]]
    if best is None:
        closest = ranked[0] if ranked else None
        summary = ("no wiring eaglewire knows reproduces the served acceptance: "
                   f"{_rates(as_trained.served_per_position) or f'τ {served.tau:.2f}'} served per position")
        if closest is not None:
            summary += (f"; the closest, {closest.wiring.label}, replays {_rates(closest.per_position)} "
                        f"(±{closest.widest:.2f}); as trained {_rates(as_trained.per_position)}")
        return Check(name, "inconclusive", summary, evidence,
                     fix="other issues remain: " + "; ".join(causes) if causes else None)
    matches = [best] + [f for f in ranked if f.matches and f is not best]
    others = [c[0].wiring.label for c in by_candidate(matches)[1:]]  # each candidate once, the best's family aside
    per_pos = (f"per-position acceptance {_rates(best.served_per_position)} served vs "
               f"{_rates(best.per_position)} replayed" if best.per_position else
               f"τ {served.tau:.2f} served vs {best.replayed.tau:.2f} replayed")
    noise = f"±{best.widest:.2f} over {n:,} drafts; τ {served.tau:.2f} vs {best.replayed.tau:.2f}"
    fixes = list(dict.fromkeys(f.wiring.fix for f in matches if f.wiring.fix))
    if len(fixes) > 1 and best.wiring.from_config:  # the config the server loads says which of them it is
        evidence.append("also within noise on this text (the served counters alone cannot tell them apart; the "
                        "config the server loads says the one named): " + "; ".join(others))
        fixes = [best.wiring.fix] if best.wiring.fix else fixes
    if len(fixes) > 1:  # wirings this text cannot tell apart, with different fixes
        evidence.append("within noise, closest first: " + "; ".join(f"{c[0].wiring.label} (fix: {c[0].wiring.fix})"
                                                                   for c in by_candidate(matches)))
        apart = f" (after {probed.said()})" if probed else ""
        labels = [best.wiring.label] + others
        remedies = {f.wiring.remedy for f in matches}
        if len(remedies) == 1 and None not in remedies:  # --engine-config holds each of them as trained: one fix
            [remedy] = remedies
            return Check(name, "fail", f"the {engine} server does not run --engine-config: its acceptance is what "
                         f"{len(labels)} wirings eaglewire knows give on its text, each of which that config holds "
                         f"as trained, and which the text cannot tell apart{apart}: {', '.join(labels)}; the closest: "
                         f"{per_pos} with {best.wiring.label} ({noise})", evidence,
                         fix=f"{remedy}: whichever of them the copy it serves holds, yours has it as trained")
        return Check(name, "fail", f"the {engine} server's acceptance is what {len(labels)} wirings eaglewire knows "
                     f"give on its text, which it cannot tell apart{apart}: {', '.join(labels)}; "
                     f"the closest: the server {best.wiring.what}, the draft was trained {best.wiring.trained}: "
                     f"{per_pos} with {best.wiring.label} ({noise})", evidence,
                     fix="one of, closest first: " + "; or ".join(fixes))
    if others and not best.wiring.from_config:
        evidence.append("also within noise (the same fix): " + ", ".join(others))
    summary = (f"the {engine} server {best.wiring.what}, the draft was trained {best.wiring.trained}: {per_pos} with "
               f"{best.wiring.label} ({noise})")
    if probed and probed.sent:
        summary += f"; told apart from the others by {len(probed.sent)} probe prompts ({probed.tokens:,} tokens)"
    return Check(name, "fail", summary, evidence, fix=best.wiring.fix)


# ---------------------------------------------------------------- proving the fixes


def proven(wirings: list[Wiring], view: ConfigView | None) -> list[Wiring]:
    """``wirings`` with each fix proven on ``view`` (``fix_proof.prove``): a fix for what the user's config already
    holds as trained changes nothing there, so the wiring is said to be another copy's, with the fix that makes
    the server load the user's or changes the copy it loads; a fix that, applied and read again, does not give
    the trained reading is not printed."""
    done: dict[tuple[str | None, str | None], tuple[str, str]] = {}
    out = []
    for w in wirings:
        key = (w.aspect, w.fix)
        if key not in done:
            done[key] = prove(w.aspect, w.fix, view)
        verdict, why = done[key]
        if verdict == "held":
            remedy = f"make the server load {view.path} (restart it on that directory)"
            out.append(replace(w, what=f"does not run --engine-config {view.path} ({why}): it runs a copy that "
                               f"{w.what}", fix=f"{remedy}, or in the copy it serves: {w.fix}", remedy=remedy,
                               dropped=f"{why}: \"{w.fix}\" changes nothing there"))
        elif verdict == "unproven":
            out.append(replace(w, fix=None, dropped=f"{why}: \"{w.fix}\" is not printed"))
        else:
            out.append(w)
    return out


# ---------------------------------------------------------------- replaying


def layout_fix(report, engine: str, engine_config: str | None, declared: list[int], num_layers: int,
               arch: str | None, dflash: bool, served_layout: list[int] | None = None) -> str:
    """The config line that makes ``engine`` feed ``declared``: the engine wiring check's fix where it
    failed, else the engine's own fix text (``engine_reading.config_fix``; llama.cpp's ``layout_problem`` on the GGUF,
    or a GGUF holding ``served_layout``; eaglewire: its draft's contract)."""
    from eaglewire import engines
    from eaglewire.doctor import engine_reading
    from eaglewire.engines import canonical

    wiring = next((c.fix for c in report.checks if c.name == "engine wiring" and c.fix), None)
    if wiring:
        return wiring
    engine = canonical(engine)
    spec = engines.get(engine)
    if spec.in_process:
        return (f"serve the draft whose contract declares {declared}: eaglewire's server feeds the boundaries "
                "its draft's contract declares (`eaglewire serve --draft DRAFT`, the trained draft's directory)")
    if spec.linter.layout_fix is not None:  # an engine that reads the layout from a draft file of its own
        return spec.linter.layout_fix(engine_config, declared, num_layers, served_layout, dflash)
    if dflash:
        cfg = {}
        if engine_config and str(engine_config).endswith(".json"):
            try:
                cfg = json.loads(Path(engine_config).read_text())
            except (OSError, ValueError):
                cfg = {}
        return engine_reading.dflash_config_fix(engine, declared, num_layers, arch, cfg)
    return engine_reading.config_fix(engine, declared, num_layers, arch)


def _probe(prober: Prober, target, draft, declared: list[int], counts, replayed, ranked: list[Fit], steps: int):
    """``probes.separate`` the wirings within noise of ``counts``: (the server's account with the probes, the trained
    wiring's replay on all of it, the best and the ranking after them, what probing did). The wirings ruled out
    before probing follow, ranked on the first text."""
    matched = still_fitting(ranked)
    candidates = {i: f.wiring for i, f in enumerate(matched)}
    trained = Wiring(tuple(declared), "as trained", "", "")
    replays = {i: f.replayed for i, f in enumerate(matched)} | {"trained": replayed}
    counts, replays, probed = separate(prober, target, draft, candidates, counts, replays, steps,
                                       shown={"trained": trained})
    best, after = judge(counts, [(w, replays[i]) for i, w in candidates.items()])
    kept = {id(f) for f in matched}
    return counts, replays["trained"], best, after + [f for f in ranked if id(f) not in kept], probed


def diagnose(report, served, target, draft, declared: list[int], prompts: list[list[int]], counts, replayed,
             steps: int, causes: list[str], prober: Prober | None = None) -> Check:
    """The served-wiring Check for a server whose ``counts`` fall below the ``replayed`` (as trained) on its own
    ``counts.outputs``: every candidate wiring replayed on that text, the one that reproduces the counters named;
    where several with different fixes do, ``prober`` asks the server more on prompts that separate them
    (``served``: ``served_check.ServedSettings``, of which it reads the engine, the config it loads and the
    target's architecture as it loads it)."""
    from eaglewire.engines import canonical
    from eaglewire.model.dflash_blocks import is_block_draft

    start = time.perf_counter()
    engine, L = canonical(served.engine), target.num_layers  # the engine's name; counts.engine: as the server says
    arch = served.target_arch or target.fingerprint.architecture
    dflash = is_block_draft(draft)
    emb_rows = None
    if prompts:
        ids = torch.tensor(sorted({i for p in prompts for i in p}))  # [N]
        with torch.no_grad():
            emb_rows = (ids, target.embed_tokens(ids.to(target.device)).float().cpu())  # [N], [N, H]
    fix = layout_fix(report, served.engine, served.engine_config, declared, L, arch, dflash)
    readings, from_config, notes, view = config_wirings(served.engine, served.engine_config, draft, declared, L, arch,
                                                        emb_rows, fix, dflash)
    spec = engines.get(engine)
    # --engine-config ranks the candidates (what it reads comes first among equal matches), never removes one:
    # the server may load another copy than the user's
    wirings = layout_wirings(declared, L, readings, fix, post_norm=not dflash) + from_config
    if not spec.in_process:
        wirings += order_wirings(engine, declared, L)
    wirings += (block_field_wirings if dflash else field_wirings)(engine, draft, target, declared)
    if engines.get(engine).linter.layout_fix is not None:  # its fix names the layout it was fed
        wirings = [replace(w, fix=layout_fix(report, served.engine, served.engine_config, declared, L, arch, dflash,
                                             list(w.layout)))
                   if w.fix == fix else w for w in wirings]
    wirings = proven(wirings, view)
    texts = capture_texts(target, draft, prompts, counts.outputs, {b for w in wirings for b in w.layout})
    replays = [(w, replay_wiring(w, draft, texts, steps)) for w in wirings]
    best, ranked = judge(counts, replays)
    probed = None
    if prober is not None and prober.budget > 0 and len({f.wiring.fix for f in ranked if f.matches}) > 1:
        counts, replayed, best, ranked, probed = _probe(prober, target, draft, declared, counts, replayed, ranked,
                                                        steps)
    seconds = time.perf_counter() - start
    check = diagnosis_check(counts, counts.engine, declared, replayed, best, ranked, causes, seconds=seconds,
                            tokens=sum(len(o) for o in counts.outputs), probed=probed)
    check.evidence += [f"the fix for {c[0].wiring.label}: {c[0].wiring.dropped}" for c in by_candidate(ranked)
                       if c[0].matches and c[0].wiring.dropped]
    check.evidence += notes
    report.served["diagnosis"] = {
        "match": None if best is None else {"label": best.wiring.label, "layout": list(best.wiring.layout),
                                            "fix": best.wiring.fix},
        "within_noise": list(dict.fromkeys(f.wiring.label for f in ranked if f.matches)),
        "dropped_fixes": {f.wiring.label: f.wiring.dropped for f in ranked if f.matches and f.wiring.dropped},
        "seconds": round(seconds, 1),
        "probes": None if probed is None else {"prompts": [p.source for p in probed.sent], "tokens": probed.tokens,
                                               "rounds": probed.rounds, "stopped": probed.stopped},
        "candidates": [_candidate_record(c) for c in by_candidate(ranked)]}
    log.info("served wiring: %d candidates in %.1f s", len(ranked), seconds)
    return check
