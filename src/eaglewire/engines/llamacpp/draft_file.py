"""What llama.cpp makes of the files it serves: the target's architecture (a GGUF's, and whether build ``BUILD``
feeds EAGLE-3 drafts for it), and the GGUF draft llama-server loads (``-md``): the boundaries it feeds, what is
wrong with the file for a trained layout (with the exact fix), its ``d2t``. Readings only: the doctor
(``doctor/checks.py`` ``check_serving``) turns them into its checks through the spec's linter."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from eaglewire.engines.interface import ArchReading, DraftFileLayout
from eaglewire.engines.llamacpp.gguf import draft_layers, layout_problem, read_gguf_metadata, vocab_problem
from eaglewire.engines.llamacpp.installation import BUILD
from eaglewire.engines.llamacpp.readings import EAGLE3_TARGET_ARCHS, GGUF_ARCH, llamacpp_arch

if TYPE_CHECKING:
    import torch

DRAFT_FILE_FIX = "pass the GGUF draft llama-server will load (--engine-config draft.gguf)"
VOCAB_FIX = ("re-export the draft with `eaglewire export --to llamacpp` (llama.cpp's converter adds draft id to an "
             "offset d2t; a checkpoint with absolute ids must be converted to offsets first)")


def arch_reading(architecture: str) -> ArchReading:
    """Whether llama.cpp (build ``BUILD``) feeds an EAGLE-3 draft for a target of ``architecture`` (transformers
    class or GGUF architecture name): its graph must expose layer inputs, others abort at load."""
    arch = llamacpp_arch(architecture)
    return ArchReading(
        build=str(BUILD), arch=arch, serves=arch in EAGLE3_TARGET_ARCHS, served=EAGLE3_TARGET_ARCHS,
        why_not="its graph does not expose layer inputs, and llama-server aborts at load "
                "(GGML_ASSERT(t_layer_inp[il] != nullptr))",
        fix="check that the target's model file in llama.cpp sets t_layer_inp (src/models/)" if arch is None else
            f"serve this draft with vLLM, SGLang or eaglewire, or use a llama.cpp build whose src/models/ file for "
            f"{arch} records t_layer_inp")


def target_file_arch(target: str) -> str | None:
    """The architecture a GGUF target records (``general.architecture``); None for any other target."""
    if not str(target).endswith(".gguf"):
        return None
    arch = read_gguf_metadata(target).get("general.architecture")
    return None if arch is None else str(arch)


def draft_file_layout(path, declared: list[int], num_layers: int, family: str = "eagle3") -> DraftFileLayout:
    """What the GGUF draft at ``path`` makes llama.cpp feed a ``family`` draft trained on ``declared`` of a
    ``num_layers``-layer target: an EAGLE-3 GGUF's ``extract_layers`` are read as fed only when they are three
    distinct boundaries 0..L (llama.cpp loads no other), a DFlash GGUF's ``target_layers`` when all are 0..L."""
    meta = read_gguf_metadata(path)
    layers = draft_layers(meta)
    recorded = f"general.architecture {meta.get('general.architecture')!r}, extract_layers {layers}"
    problem = layout_problem(meta, declared, num_layers, where=str(path), family=family)
    fed = bool(layers) and all(0 <= x <= num_layers for x in layers)
    if family != "dflash":
        fed = fed and len(layers) == 3 and len(set(layers)) == 3
    return DraftFileLayout(recorded=recorded, feeds=[int(x) for x in layers] if fed else None, problem=problem)


def draft_file_vocab(path, vocab_ids: torch.Tensor | None) -> str | None:
    """What is wrong with the GGUF draft's d2t for a draft over the target ids ``vocab_ids`` [Vd] (None: the whole
    vocabulary, no d2t); None where llama.cpp reads the draft's predictions as the tokens it was trained over."""
    return vocab_problem(Path(path), vocab_ids, where=str(path))


def draft_file_layers(path) -> list[int] | None:
    """The boundaries a draft GGUF makes llama.cpp feed (its ``extract_layers`` / DFlash ``target_layers``)."""
    layers = draft_layers(read_gguf_metadata(path))
    return [int(x) for x in layers] if layers else None


def layout_fix(engine_config: str | None, declared: list[int], num_layers: int, served_layout: list[int] | None,
               dflash: bool) -> str:
    """The fix that makes llama-server feed ``declared``: ``layout_problem`` on the GGUF given, or on a GGUF holding
    ``served_layout`` where the one given is wired as trained (the server loads another one)."""
    meta, where = None, "the GGUF llama-server loads"
    if engine_config and str(engine_config).endswith(".gguf"):
        try:
            meta, where = read_gguf_metadata(engine_config), engine_config
        except Exception:  # noqa: BLE001 - the engine checks report an unreadable GGUF
            meta = None
    shown = list(served_layout or [])
    if (meta is None or draft_layers(meta) == list(declared)) and shown and min(shown) >= 0:
        meta, where = {"general.architecture": GGUF_ARCH, f"{GGUF_ARCH}.target_layers": shown}, \
            "the GGUF llama-server loads"
    problem = (layout_problem(meta, declared, num_layers, where=where, family="dflash" if dflash else "eagle3")
               if meta is not None else None)
    return problem or (f"re-export with `eaglewire export --to llamacpp --draft DRAFT --out DIR`: its GGUF's "
                       f"extract_layers are {declared}, which llama.cpp feeds as the boundaries trained")
