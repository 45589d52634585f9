"""llama.cpp's DFlash format: a GGUF DFlash draft made by llama.cpp's own converter.

``convert_hf_to_gguf.py`` reads z-lab's layout (``DFlashDraftModel``) and writes architecture ``dflash`` with
``dflash.target_layers = [i + 1 for i in target_layer_ids]``, which the runtime reads as layer inputs: the
contract's boundaries (``gguf.dflash_layout_problem`` checks them after conversion). A draft over a pruned
vocabulary goes through the converter's DSpark class, the one that writes ``d2t`` at this build (below).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import eaglewire.engines.llamacpp.installation as engine
import eaglewire.engines.formats.zlab_layout as zlab
from eaglewire.core.fileio import atomic_write_text
from eaglewire.engines.formats.dflash_layout import head_rows_tensor
from eaglewire.engines.export import ExportConfig, ExportReport, OtherReadings, check_choice, write_export
from eaglewire.engines.llamacpp.gguf import (convert_draft, converter_target, dflash_layout_problem, link_target,
                                             read_gguf_metadata, vocab_problem)
from eaglewire.engines.llamacpp.readings import DRAFT_OUTTYPES, TARGET_OUTTYPES, dflash_to_ids
from eaglewire.engines.formats.eagle3_layout import FormatError
from eaglewire.model.checkpoint import DraftFiles
from eaglewire.model.target import load_target
from eaglewire.model.vocab import target_ids


def dflash_serving_md(*, target_gguf: str, draft_gguf: str, boundaries: list[int], block_size: int,
                      threads: int, draft_vocab_size: int | None = None) -> str:
    t, n = str(threads), block_size - 1
    vocab = [] if draft_vocab_size is None else [
        f"The draft predicts over {draft_vocab_size} of the target's tokens: the GGUF holds the target head's rows of "
        "them (`output.weight`) and `d2t` (their target ids), which llama.cpp scatters the draft's logits "
        "through.", ""]
    return "\n".join([
        "# Serving this DFlash draft with llama.cpp", "",
        f"GGUF DFlash draft (llama.cpp build {engine.BUILD}). It reads target boundaries {boundaries}; llama.cpp reads "
        f"the input of layer i for each of `dflash.target_layers` {boundaries} (verified after conversion).", "",
        "```bash", f"llama-server -m {target_gguf} \\", f"    -md {draft_gguf} \\",
        f"    --spec-type draft-dflash --spec-draft-n-max {n} --spec-draft-n-min 0 --spec-draft-p-min 0 \\",
        f"    -t {t} -tb {t} -td {t} -tbd {t}", "```", "",
        f"One draft pass fills a block of {block_size} positions (the anchor and {n} masks): llama.cpp clamps "
        f"`--spec-draft-n-max` to block_size - 1 = {n} (common_speculative_impl_draft_dflash). Pin the threads "
        "(`-t/-tb/-td/-tbd`).", "", *vocab])


# llama.cpp b11434's converter writes a pruned vocabulary's `d2t` only in DSparkModel (conversion/qwen.py), the
# DFlashModel subclass whose Markov and confidence heads are optional. Without them it writes DFlashModel's GGUF
# (architecture dflash, the same target_layers, block size and mask token) plus `d2t` as absolute target ids, the
# head's rows as `output.weight` (t2d dropped), and `dflash.sample_from_anchor = true`, the value
# src/models/dflash.cpp assumes when the key is absent. The runtime reads `d2t` for every dflash GGUF
# (llama_model_dflash::load_arch_tensors) and scatters the rows' logits to target ids under --spec-type draft-dflash.
PRUNED_CONVERTER_ARCHITECTURE = "DSparkDraftModel"


def pruned_converter_input(draft: DraftFiles, out: Path, *, target, allow) -> list[str]:
    """A DFlash ``draft`` over a pruned vocabulary in z-lab's layout as llama.cpp's converter reads one (above):
    config.json with ``draft_vocab_size`` and the DSpark architecture name, ``d2t`` (offsets) / ``t2d`` and the
    target head's rows as ``lm_head.weight``. Returns the notes (dtype, target checks)."""
    contract, cfg = draft.contract, draft.draft_config
    notes: list[str] = contract.check_target(target.fingerprint, what=f"draft {draft.path}", allow=allow)
    config, dtype = zlab.export_config(draft, f"llama.cpp {engine.BUILD} converter", notes)
    config.update(architectures=[PRUNED_CONVERTER_ARCHITECTURE], draft_vocab_size=cfg.draft_vocab_size)
    tensors = draft.state()  # d2t (offsets) and t2d
    tensors["lm_head.weight"] = head_rows_tensor(tensors["d2t"], target, getattr(torch, dtype))  # [Vd, H]
    write_export(out, config, tensors, "\n".join([
        "# The input of llama.cpp's converter for this DFlash draft", "",
        f"z-lab's layout with the draft's pruned vocabulary ({cfg.draft_vocab_size} of {cfg.vocab_size} tokens: "
        "`d2t`, `t2d`, the target head's rows as `lm_head.weight`). `architectures` names llama.cpp's DSpark "
        "converter class, the one that writes `d2t` at this build; without DSpark's extra heads it writes a plain "
        "DFlash GGUF. For SGLang, which reads no `d2t`, train with the whole vocabulary; for vLLM, `--to vllm`.", ""]))
    return notes


def export_dflash(draft: DraftFiles, fmt: str, out: Path, config: ExportConfig, *, target=None,
                  allow: frozenset[str] | set[str] = frozenset(), others: OtherReadings | None = None) -> ExportReport:
    """A DFlash ``draft`` as GGUF: z-lab's layout in ``out/zlab`` converted by llama.cpp's own converter into
    ``draft-<outtype>.gguf``, read back and refused unless it is a ``dflash`` GGUF with target_layers = the
    contract's boundaries; the target GGUF beside it (as for EAGLE-3) and SERVING.md."""
    check_choice(config.outtype, DRAFT_OUTTYPES, "--outtype")
    check_choice(config.target_outtype, TARGET_OUTTYPES, "--target-outtype")
    contract = draft.contract
    bounds, L = list(contract.aux_boundaries), contract.num_layers
    dflash_to_ids(bounds, L)
    zlab.to_ids(bounds, L, None)  # the layout it converts from: refuses before any heavy work
    tree = engine.require_tree(config.llamacpp_dir)
    spec, target_dir = converter_target(draft, config)
    pruned = draft.draft_config.pruned
    if pruned:
        staged = out / "converter-input"
        target = target if target is not None else load_target(spec, device="cpu", dtype="fp32")
        notes = pruned_converter_input(draft, staged, target=target, allow=allow)
    else:
        staged = out / "zlab"
        notes = zlab.export(draft, "zlab", staged, config).notes
    draft_file = convert_draft(tree, staged, out / f"draft-{config.outtype}.gguf", config.outtype,
                               target_dir=target_dir, architecture=contract.target.architecture)
    problem = dflash_layout_problem(read_gguf_metadata(draft_file), bounds, L, where=str(draft_file))
    if problem is None and pruned:
        problem = vocab_problem(draft_file, target_ids(draft.state()["d2t"].long()), where=str(draft_file))
    if problem:
        raise FormatError(f"the converter wrote a draft llama.cpp would miswire: {problem}")
    files = [f"{staged.name}/", draft_file.name]
    link = link_target(out, target_dir, contract.target.architecture, config.target_outtype, tree=tree)
    if link is not None:
        files.append(link.name)
        shown = str(link.absolute())
    else:
        shown = str(Path(spec).expanduser()) if str(spec).endswith(".gguf") else "<the target as GGUF>"
    atomic_write_text(out / "SERVING.md", dflash_serving_md(target_gguf=shown, draft_gguf=str(draft_file.resolve()),
                                                            boundaries=bounds, block_size=draft.draft_config.block_size,
                                                            threads=config.threads,
                                                            draft_vocab_size=draft.draft_config.draft_vocab_size
                                                            if pruned else None))
    atomic_write_text(out / "eaglewire-export.json", json.dumps(
        {"contract": contract.to_dict(), "exported_from": str(draft.path), "target_layers": bounds,
         "draft_gguf": draft_file.name, "outtype": config.outtype, "llamacpp_build": engine.BUILD}, indent=2))
    files += ["SERVING.md", "eaglewire-export.json"]
    return ExportReport(format=fmt, out_dir=out, aux_boundaries=bounds, engine_ids=bounds, files=files,
                        notes=notes)
