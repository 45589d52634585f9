"""llama.cpp's EAGLE-3 format: a GGUF draft made by llama.cpp's own converter.

``convert_hf_to_gguf.py SPECULATORS_DIR --target-model-dir TARGET`` reads a directory in the
speculators layout (engines/formats/speculators_layout.py, the one vLLM loads) and writes architecture ``eagle3`` with ``eagle3.target_layers`` (llama.cpp's
``extract_layers``: it copies the *input* of layer i for id i, so ids are boundaries verbatim,
exactly 3), ``eagle3.target_hidden_size`` and the norm flags. The export runs that converter
with the tree's own gguf-py, reads the GGUF back with the ``gguf`` package and refuses a file
whose layers differ from the contract. It also writes the target as GGUF (f32/f16 of the very
weights eaglewire runs) and ``SERVING.md`` with the llama-server command.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from dataclasses import replace

import torch

from eaglewire.model.checkpoint import DraftFiles
from eaglewire.engines.export import ExportConfig, ExportReport, OtherReadings, check_choice, finish
import eaglewire.engines.llamacpp.installation as engine
from eaglewire.engines.llamacpp.readings import (DFLASH_GGUF_ARCH, DRAFT_OUTTYPES, GGUF_ARCH, TARGET_OUTTYPES,
                                                 dflash_to_ids, to_ids)
from eaglewire.engines.formats.eagle3_layout import FormatError
import eaglewire.engines.formats.speculators_layout as speculators
from eaglewire.core.fileio import atomic_path, atomic_write_text
from eaglewire.core.presets import cache_dir

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ reading a GGUF draft

def gguf_reader(path: str | Path):
    """gguf-py's ``GGUFReader`` of ``path``, parsed once per file version: parsing walks every field
    part in Python, ~5 s for a draft GGUF that carries SmolLM2's 49k-token vocabulary, and the export's
    read-back and the doctor read one file several times (metadata, d2t, the head's rows)."""
    stat = Path(path).stat()
    return _parsed(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)  # a few open memory maps at most
def _parsed(path: str, mtime_ns: int, size: int):
    from gguf import GGUFReader

    return GGUFReader(path)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (tensors are not read)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        reader = gguf_reader(path)
    except (ValueError, OSError) as e:
        raise FormatError(f"{path} is not a readable GGUF file: {e}") from e
    out: dict[str, Any] = {}
    for name, f in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name != "tokenizer.ggml.model":
            continue  # vocabularies: large and not needed here
        try:
            value = f.contents()
        except (ValueError, IndexError, TypeError):
            continue
        out[name] = value
    out["tensor_names"] = [t.name for t in reader.tensors]
    return out


def draft_layers(meta: dict[str, Any]) -> list[int] | None:
    """llama.cpp's extract_layers of a GGUF draft (``<arch>.target_layers``), None if absent."""
    arch = meta.get("general.architecture")
    value = meta.get(f"{arch}.target_layers")
    return None if value is None else [int(v) for v in value]


def layout_problem(meta: dict[str, Any], boundaries: list[int], num_layers: int, *,
                   target_hidden_size: int | None = None, where: str = "the GGUF", family: str = "eagle3") -> str | None:
    """What is wrong with a GGUF draft for a contract on ``boundaries`` of an
    ``num_layers``-layer target, with the exact fix; None when llama.cpp will feed it as trained.
    ``family``: the draft's (a DFlash draft's GGUF is ``dflash_layout_problem``'s)."""
    if family == "dflash":
        return dflash_layout_problem(meta, boundaries, num_layers, where=where)
    arch = meta.get("general.architecture")
    if arch != GGUF_ARCH:
        return (f"{where} has architecture {arch!r}, not {GGUF_ARCH!r}: llama.cpp will not run it as an EAGLE-3 "
                "draft. Convert the speculators export with llama.cpp's converter "
                "(`eaglewire export --to llamacpp`)")
    want = to_ids(boundaries, num_layers)
    have = draft_layers(meta)
    if have != want:
        shown = "no target_layers (llama.cpp refuses to load it)" if have is None else f"extract_layers {have}"
        return (f"{where} has {shown}, but the draft was trained on boundaries {boundaries}, for which llama.cpp "
                f"needs extract_layers {want} (the input of layer i for id i). Fix: re-export with "
                "`eaglewire export --to llamacpp --draft DRAFT --out DIR`, or set "
                f'"eagle_aux_hidden_state_layer_ids": {json.dumps(want)} in the speculators config.json and '
                "convert it again")
    hidden = meta.get(f"{arch}.target_hidden_size")
    if target_hidden_size is not None and hidden is not None and int(hidden) != target_hidden_size:
        return (f"{where} has target_hidden_size {int(hidden)} but the target's hidden size is {target_hidden_size}: "
                "the draft was made for another target")
    if meta.get(f"{arch}.norm_before_residual"):
        return (f"{where} sets norm_before_residual: llama.cpp will normalise the residual, which an eaglewire draft "
                "does not; convert from a config with \"norm_before_residual\": false")
    return None


# ------------------------------------------------------------------ running the converter

def target_architecture(target_dir: Path) -> str:
    """The transformers class of a target directory (config.json's architectures, else the
    causal-LM class registered for its model_type)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = json.loads((target_dir / "config.json").read_text())
    if config.get("architectures"):
        return str(config["architectures"][0])
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type", ""))
    if name is None:
        raise FormatError(f"{target_dir / 'config.json'} names no architectures and model_type "
                          f"{config.get('model_type')!r} is not a causal LM transformers knows")
    return name


def converter_target_dir(target_dir: Path, architecture: str, into: Path) -> Path:
    """A directory the converter accepts as ``--target-model-dir``: every file of ``target_dir``
    linked, config.json rewritten with ``architectures`` when it lacks them (the converter
    refuses a config without; dequantized GGUF targets have none)."""
    config = json.loads((target_dir / "config.json").read_text())
    into.mkdir(parents=True, exist_ok=True)
    for item in target_dir.iterdir():
        if item.name != "config.json" and not (into / item.name).exists():
            (into / item.name).symlink_to(item.resolve())
    if not config.get("architectures"):
        config["architectures"] = [architecture]
    (into / "config.json").write_text(json.dumps(config, indent=2))
    return into


def _check_sentencepiece() -> None:
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        raise engine.LlamaCppError("llama.cpp's converter needs sentencepiece: pip install 'eaglewire[llamacpp]' "
                                   "(or pip install sentencepiece)") from None


def run_converter(tree: Path, model_dir: Path, outfile: Path, outtype: str, *,
                  target_model_dir: Path | None = None) -> Path:
    """``convert_hf_to_gguf.py`` of ``tree`` with that tree's gguf-py first on PYTHONPATH."""
    _check_sentencepiece()
    cmd = [sys.executable, str(tree / engine.CONVERTER), str(model_dir), "--outfile", str(outfile),
           "--outtype", outtype]
    if target_model_dir is not None:
        cmd += ["--target-model-dir", str(target_model_dir)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "gguf-py")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    outfile.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s -> %s (%s) with llama.cpp's converter", model_dir, outfile.name, outtype)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not outfile.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
        raise engine.LlamaCppError(f"llama.cpp's converter failed on {model_dir} (exit {proc.returncode}):\n{tail}")
    return outfile


def target_gguf(target_dir: Path, architecture: str, outtype: str, *, tree: Path) -> Path:
    """The target as a GGUF of ``outtype``, converted once into the cache."""
    key = hashlib.sha256(f"{target_dir.resolve()}:{(target_dir / 'config.json').stat().st_mtime_ns}".encode())
    out = cache_dir() / "gguf" / f"{target_dir.name}-{key.hexdigest()[:12]}-{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp, atomic_path(out, suffix=".partial") as partial:
        src = converter_target_dir(target_dir, architecture, Path(tmp) / "target")
        run_converter(tree, src, partial, outtype)
    return out


def converter_target(draft: DraftFiles, config: ExportConfig) -> tuple[str, Path]:
    """(the target's spec, its directory) for llama.cpp's converter: ``config.target_path``, else the draft's own."""
    from eaglewire.model.target import resolve_target_path

    spec = str(config.target_path) if config.target_path is not None else draft.target_spec
    if not spec:
        raise FormatError(f"draft {draft.path} records no target; llama.cpp's converter needs the target's directory "
                          "(pass target_path)")
    return spec, resolve_target_path(spec)


def convert_draft(tree: Path, staged: Path, draft_file: Path, outtype: str, *, target_dir: Path,
                  architecture: str) -> Path:
    """``run_converter`` on a staged draft directory, with the target directory the converter accepts."""
    with tempfile.TemporaryDirectory() as tmp:
        conv_target = converter_target_dir(target_dir, architecture, Path(tmp) / "target")
        return run_converter(tree, staged, draft_file, outtype, target_model_dir=conv_target)


def link_target(out: Path, target_dir: Path, architecture: str, outtype: str, *, tree: Path) -> Path | None:
    """``out/target-<outtype>.gguf``, a link to the cached conversion of the target; None for outtype none."""
    if outtype == "none":
        return None
    cached = target_gguf(target_dir, architecture, outtype, tree=tree)
    link = out / f"target-{outtype}.gguf"
    link.unlink(missing_ok=True)
    link.symlink_to(cached)
    return link


# ------------------------------------------------------------------ export

def serving_md(*, target_gguf: str, draft_gguf: str, boundaries: list[int], ids: list[int], num_steps: int,
               threads: int, other_targets: list[str]) -> str:
    t = str(threads)
    cmd = [f"llama-server -m {target_gguf} \\", f"    -md {draft_gguf} \\",
           f"    --spec-type draft-eagle3 --spec-draft-n-max {num_steps} --spec-draft-n-min 0 --spec-draft-p-min 0 \\",
           f"    -t {t} -tb {t} -td {t} -tbd {t}"]
    lines = ["# Serving this draft with llama.cpp", "",
             f"GGUF EAGLE-3 draft (llama.cpp build {engine.BUILD}). It reads target boundaries {boundaries}; llama.cpp "
             f"copies the input of layer i for id i, so its `extract_layers` are {ids} (verified after conversion).", "",
             "```bash", *cmd, "```", "",
             "llama.cpp drafts a greedy chain of `--spec-draft-n-max` tokens per step; `--spec-draft-p-min 0` keeps "
             "every drafted token (a higher value stops drafting at an unsure token), `--spec-draft-n-min 0` keeps "
             "short drafts. Pin the threads (`-t/-tb/-td/-tbd`): llama.cpp's threads collapse when other "
             "processes share the cores.", "",
             "llama.cpp feeds EAGLE-3 drafts only for targets whose graph exposes layer inputs (llama, qwen3, "
             "qwen3moe, qwen35, qwen3next, gemma4, gpt-oss, lfm2, nemotron-h, ... at this build; not gemma3, qwen2, "
             "mistral3, phi3, olmo, granite, glm4, deepseek2). `eaglewire doctor --engine llamacpp` checks it.", ""]
    if other_targets:
        lines += ["The target this draft was trained for is also available as " + ", ".join(f"`{p}`" for p in other_targets)
                  + "; a requantized target (e.g. Q4) serves faster but accepts slightly fewer draft tokens.", ""]
    return "\n".join(lines)


def converter_input_md(boundaries: list[int], target_dir: Path) -> str:
    """SERVING.md of the converter's input, ``out/speculators`` (kept beside the GGUF it was converted into)."""
    return "\n".join([
        "# The input of llama.cpp's converter for this draft", "",
        f"speculators' EAGLE-3 layout: `eagle_aux_hidden_state_layer_ids` {json.dumps(boundaries)} are the draft's "
        f"boundaries. llama.cpp's converter (build {engine.BUILD}) read it with `--target-model-dir {target_dir}` "
        "into the draft GGUF beside this folder; serve that one (../SERVING.md). For vLLM, export the native draft "
        "with `eaglewire export --to vllm`, whose SERVING.md gives vLLM's own launch command and checks.", ""])


def export(draft: DraftFiles, fmt: str, out: Path, config: ExportConfig, *, target=None,
           allow: frozenset[str] | set[str] = frozenset(), others: OtherReadings) -> ExportReport:
    """Write ``draft-<outtype>.gguf`` (and ``target-<target_outtype>.gguf``, a link to the cached
    conversion) plus ``SERVING.md`` into ``out``; the speculators directory it is converted from
    stays in ``out/speculators``. ``config.target_path``: the target's directory or .gguf
    (default: the one the draft records). Raises EngineConventionError for a layout llama.cpp
    cannot feed, FormatError when the written GGUF does not carry the contract's layers."""
    check_choice(config.outtype, DRAFT_OUTTYPES, "--outtype")
    check_choice(config.target_outtype, TARGET_OUTTYPES, "--target-outtype")
    contract = draft.contract
    bounds, L = list(contract.aux_boundaries), contract.num_layers
    ids = to_ids(bounds, L)  # refuses before any heavy work
    tree = engine.require_tree(config.llamacpp_dir)
    spec, target_dir = converter_target(draft, config)
    if target is None and config.target_path is not None:
        from eaglewire.model.target import load_target

        target = load_target(spec, device="cpu", dtype="fp32")  # its embedding goes into the speculators export
    staged = out / "speculators"
    _, notes = speculators.write(draft, staged, replace(config, verifier_name=config.verifier_name or str(target_dir)),
                                 engine=f"llama.cpp {engine.BUILD} converter", arch=None, target=target, allow=allow,
                                 serving=lambda _: converter_input_md(bounds, target_dir))
    architecture = contract.target.architecture
    outtype, target_outtype = config.outtype, config.target_outtype
    draft_file = convert_draft(tree, staged, out / f"draft-{outtype}.gguf", outtype,
                               target_dir=target_dir, architecture=architecture)
    meta = read_gguf_metadata(draft_file)
    problem = layout_problem(meta, bounds, L, target_hidden_size=contract.target.hidden_size, where=str(draft_file))
    if problem:
        raise FormatError(f"the converter wrote a draft llama.cpp would miswire: {problem}")
    files = ["speculators/", draft_file.name]
    others_found = [str(Path(spec).expanduser())] if spec and str(spec).endswith(".gguf") else []
    if spec and not others_found:
        from eaglewire.core.presets import TARGET_PRESETS, fetch_asset

        if spec in TARGET_PRESETS:
            others_found = [str(fetch_asset(TARGET_PRESETS[spec].asset))]
    link = link_target(out, target_dir, architecture, target_outtype, tree=tree)
    if link is not None:
        files.append(link.name)
        target_shown = str(link.absolute())
    else:
        target_shown = others_found[0] if others_found else "<the target as GGUF>"
    atomic_write_text(out / "SERVING.md", serving_md(
        target_gguf=target_shown, draft_gguf=str(draft_file.resolve()), boundaries=bounds, ids=ids,
        num_steps=config.num_steps, threads=config.threads,
        other_targets=[o for o in others_found if o != target_shown]))
    atomic_write_text(out / "eaglewire-export.json", json.dumps(
        {"contract": contract.to_dict(), "exported_from": str(draft.path), "extract_layers": ids,
         "draft_gguf": draft_file.name, "outtype": outtype, "llamacpp_build": engine.BUILD}, indent=2))
    files += ["SERVING.md", "eaglewire-export.json"]
    return finish(ExportReport(format=fmt, out_dir=out, aux_boundaries=bounds, engine_ids=ids, files=files,
                               notes=notes))


# ------------------------------------------------------------------ DFlash

def dflash_layout_problem(meta: dict[str, Any], boundaries: list[int], num_layers: int, *,
                          where: str = "the GGUF") -> str | None:
    """What is wrong with a GGUF DFlash draft for a contract on ``boundaries``, naming the key, the value
    written and the value to write; None when llama.cpp will feed it as trained."""
    arch = meta.get("general.architecture")
    if arch != DFLASH_GGUF_ARCH:
        return (f"{where} has general.architecture {arch!r}, not {DFLASH_GGUF_ARCH!r}: llama.cpp will not run it as a "
                "DFlash draft (--spec-type draft-dflash). Convert z-lab's layout with llama.cpp's converter "
                "(`eaglewire export --to llamacpp`)")
    want = dflash_to_ids(boundaries, num_layers)
    have = draft_layers(meta)
    if have != want:
        shown = "no dflash.target_layers (llama.cpp refuses to load it)" if have is None else \
            f"dflash.target_layers {have}"
        return (f"{where} has {shown}, but the draft was trained on boundaries {boundaries}: llama.cpp reads the input "
                f"of layer i for each target layer, so dflash.target_layers must be {want}. Fix: re-export with "
                "`eaglewire export --to llamacpp`, or write \"dflash_config\": {\"target_layer_ids\": "
                f"{json.dumps([b - 1 for b in want])}}} in the z-lab config.json (the converter adds 1) and convert again")
    return None


def reader_tensor(path: Path, name: str):
    """gguf-py's ``ReaderTensor`` called ``name`` in a GGUF file (data, type, shape), None when absent."""
    return next((t for t in gguf_reader(path).tensors if t.name == name), None)


def gguf_tensor(path: Path, name: str):
    """One tensor of a GGUF file as a numpy array (in the file's own layout), None when absent."""
    t = reader_tensor(path, name)
    return None if t is None else t.data


def vocab_problem(path: Path, ids: torch.Tensor | None, *, where: str) -> str | None:
    """What is wrong with a GGUF draft's ``d2t`` for a draft over the target ids ``ids`` [Vd] (None: the target's
    whole vocabulary, no d2t); None when llama.cpp scatters the draft's logits to the tokens it was trained over.
    llama.cpp's converter writes d2t as absolute target ids for both families."""
    written = gguf_tensor(path, "d2t")
    if ids is None:
        return None if written is None else (
            f"{where} has a d2t of {written.size} ids, but the draft predicts over the target's whole vocabulary: "
            "llama.cpp would read its logits as those tokens only")
    if written is None:
        return f"{where} has no d2t: llama.cpp would read the {len(ids)} draft rows as the first {len(ids)} token ids"
    wrong = int((written != ids.cpu().numpy()).sum()) if written.shape == tuple(ids.shape) else len(ids)
    if wrong:
        return (f"{where}'s d2t names other tokens than the draft was trained over ({wrong} of {len(ids)} ids differ; "
                "offsets read as absolute ids, or another draft's vocabulary)")
    return None
