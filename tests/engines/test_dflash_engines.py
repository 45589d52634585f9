"""DFlash drafts in every engine's own reading: export -> import is exact in each layout, the ids are what
the engines' released code (the pinned wheels, run from their source) captures, and the doctor FAILs a
config whose ids are shifted by one, naming the key, the value written and the value to write."""

from __future__ import annotations

import ast
import json
from types import SimpleNamespace

import pytest
import torch

from eaglewire import engines
from eaglewire.core.contract import EngineConventionError
from eaglewire.doctor.doctor_config import DoctorConfig
from eaglewire.doctor.doctor_command import run_doctor
from eaglewire.engines import sglang, vllm
from eaglewire.engines.formats import zlab_layout
from eaglewire.engines.llamacpp import dflash_layout_problem
from eaglewire.model.checkpoint import load_draft
from tiny import save_random_dflash_draft, tiny_target

L = 8
BOUNDS = [2, 4, 6]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", num_layers=L, hidden_size=64, vocab_size=256)


@pytest.fixture(scope="module")
def native(tmp_path_factory, target):
    return save_random_dflash_draft(tmp_path_factory.mktemp("dflash") / "native", target, BOUNDS)


@pytest.mark.parametrize("to, back, ids_key", [("zlab", "zlab", ("dflash_config", "target_layer_ids")),
                                               ("sglang", "specforge", ("dflash_config", "target_layer_ids")),
                                               ("speculators", "speculators", ("aux_hidden_state_layer_ids",))])
def test_export_then_import_is_exact_in_each_layout(tmp_path, target, native, to, back, ids_key):
    report = engines.export_draft(native, to, tmp_path / to, target_arch="llama")
    config = json.loads((tmp_path / to / "config.json").read_text())
    written = config
    for k in ids_key:
        written = written[k]
    assert written == report.engine_ids == engines.to_engine(BOUNDS, L, to, target_arch="llama", family="dflash")
    config.pop("eaglewire")  # engines ignore the record: the ids alone must read back
    (tmp_path / to / "config.json").write_text(json.dumps(config))
    engines.import_draft(tmp_path / to, back, target, tmp_path / "back")
    a, ca, _ = load_draft(native)
    b, cb, _ = load_draft(tmp_path / "back")
    assert ca == cb and cb.family == "dflash" and list(cb.aux_boundaries) == BOUNDS
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())


def test_the_readings_differ_as_the_engines_do():
    """z-lab and SGLang store boundary - 1, vLLM and llama.cpp the boundaries; EAGLE-3 is untouched."""
    assert engines.to_engine([2, 4, 6], L, "zlab", family="dflash") == [1, 3, 5]
    assert engines.to_engine([2, 4, 6], L, "sglang", target_arch="qwen3", family="dflash") == [1, 3, 5]
    assert engines.to_engine([0, 4, 8], L, "vllm", target_arch="llama", family="dflash") == [0, 4, 8]
    assert engines.to_engine([0, 4, 7], L, "llamacpp", family="dflash") == [0, 4, 7]
    assert engines.to_engine([2, 4, 6], L, "llamacpp") == [2, 4, 6]  # EAGLE-3, the default family
    for engine, bounds, arch in (("zlab", [0, 4, 6], None), ("zlab", [2, 4, 8], None), ("sglang", [0, 4, 6], "llama"),
                                 ("sglang", [2, 4, 8], "llama"), ("sglang", [2, 4, 6], "qwen2"),
                                 ("llamacpp", [2, 4, 8], None), ("eagle", [2, 4, 6], None)):
        with pytest.raises(EngineConventionError):
            engines.to_engine(bounds, L, engine, target_arch=arch, family="dflash")
    assert engines.to_engine([2, 4, 8], L, "sglang", target_arch="gpt_oss", family="dflash") == [1, 3, 7]


def _shifted_zlab(tmp_path, native) -> str:
    """A z-lab config whose target_layer_ids are the boundaries themselves: one layer too deep."""
    engines.export_draft(native, "zlab", tmp_path / "z")
    config = json.loads((tmp_path / "z" / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = BOUNDS
    (tmp_path / "z" / "config.json").write_text(json.dumps(config))
    return str(tmp_path / "z" / "config.json")


@pytest.mark.parametrize("engine, key, want", [("sglang", "dflash_config.target_layer_ids", "[1, 3, 5]"),
                                               ("vllm", "dflash_config.target_layer_ids", "[1, 3, 5]")])
def test_the_doctor_fails_ids_shifted_by_one_with_the_fix(tmp_path, target, native, engine, key, want, monkeypatch):
    import eaglewire.doctor.doctor_command as doctor_run

    # the engine checks come first; this tokenizer-less target has no held-out text for the measured ones
    monkeypatch.setattr(doctor_run, "_load_sequences", lambda *a, **k: ([], "none"))
    report = run_doctor(DoctorConfig(draft=str(native), engine=engine, engine_config=_shifted_zlab(tmp_path, native),
                                     target_arch="llama", tune=False), target=target)
    wiring = next(c for c in report.checks if c.name == "engine wiring")
    assert wiring.verdict == "fail" and report.failed
    assert f"{key} is [2, 4, 6]" in wiring.fix and want in wiring.fix, wiring.fix
    assert any("[3, 5, 7]" in e for e in wiring.evidence)  # what the engine captures instead
    right = tmp_path / "right"
    engines.export_draft(native, engine, right, target_arch="llama")
    ok = run_doctor(DoctorConfig(draft=str(native), engine=engine, engine_config=str(right / "config.json"),
                                 target_arch="llama", tune=False), target=target)
    assert next(c for c in ok.checks if c.name == "engine wiring").verdict == "ok"


def test_a_shifted_dflash_gguf_is_named_with_the_fix():
    meta = {"general.architecture": "dflash", "dflash.target_layers": [3, 5, 7]}
    problem = dflash_layout_problem(meta, BOUNDS, L)
    assert "dflash.target_layers [3, 5, 7]" in problem and "must be [2, 4, 6]" in problem
    assert '"target_layer_ids": [1, 3, 5]' in problem
    assert dflash_layout_problem({**meta, "dflash.target_layers": [2, 4, 6]}, BOUNDS, L) is None
    assert "not 'dflash'" in dflash_layout_problem({**meta, "general.architecture": "eagle3"}, BOUNDS, L)


# ---------------------------------------------------------------- the engines' own code

def _function(wheel, path: str, name: str, cls: str | None = None) -> ast.FunctionDef:
    tree = wheel.tree(path)
    scope = tree.body if cls is None else next(n for n in tree.body if isinstance(n, ast.ClassDef)
                                               and n.name == cls).body
    return next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)


def _compile(node: ast.FunctionDef, **names):
    node = ast.fix_missing_locations(ast.FunctionDef(name=node.name, args=node.args, body=node.body, decorator_list=[],
                                                     returns=None, type_comment=None, type_params=[]))
    namespace = {"List": list, "Optional": object, **names}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "<engine>", "exec"), namespace)  # noqa: S102
    return namespace[node.name]


@pytest.mark.engines
def test_vllm_captures_what_its_reading_says_for_both_layouts(tmp_path, wheels, native):
    """vLLM 0.33.0's update_dflash (speculators layout) and get_eagle3_aux_layers_from_config, run from the
    wheel on eaglewire's exports: the runner's ids are the boundaries, and read_dflash_ids agrees."""
    w = wheels["vllm"]
    ids_of = _compile(_function(w, "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py",
                                "get_eagle3_aux_layers_from_config"))
    update = _compile(_function(w, "vllm/transformers_utils/configs/speculators/algos.py", "update_dflash"))
    for to in ("zlab", "speculators"):
        engines.export_draft(native, to, tmp_path / to, target_arch="llama")
        config = json.loads((tmp_path / to / "config.json").read_text())
        hf = dict(config)
        if to == "speculators":
            hf = {}
            update(config, hf)
            assert hf["dflash_config"]["causal"] is False  # the block stays bidirectional, as trained
        spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(**hf)))
        runner_ids = list(ids_of(spec))
        found, _ = vllm.read_dflash_ids(config)
        assert next(iter(found.values())) == runner_ids
        assert engines.from_engine(runner_ids, L, "vllm", target_arch="llama", family="dflash") == BOUNDS


@pytest.mark.engines
def test_sglang_dflash_capture_is_each_model_files_own(wheels):
    """Every model file's set_dflash_layers_to_capture, run from the SGLang wheel: layers_to_capture = id + 1,
    and files without one are the ones eaglewire refuses."""
    w = wheels["sglang"]
    ran = 0
    for arch, f in sglang.DFLASH_FILES.items():
        cls = f.function.split(".")[0]
        tree = w.tree(f.path)
        node = next((n for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls for n in c.body
                     if isinstance(n, ast.FunctionDef) and n.name == sglang.DFLASH_FUNCTION), None)
        if f.unsupported:
            assert node is None and sglang.DFLASH_FUNCTION not in w.text(f.path), arch
            continue
        assert node is not None, (arch, f.path)
        fn = _compile(node)
        me = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), model=SimpleNamespace())
        fn(me, [1, 3, 5])
        assert me.model.layers_to_capture == [2, 4, 6], arch
        assert engines.from_engine([1, 3, 5], L, "sglang", target_arch=arch, family="dflash") == [2, 4, 6]
        ran += 1
    assert ran >= 5  # llama, mistral, qwen3, deepseek_v3, glm4_moe_lite, gpt_oss
    reader = w.text("sglang/srt/speculative/dflash_utils.py")
    assert 'dflash_cfg.get(\n        "target_layer_ids",' in reader and "val < 0 or val >= target_num_layers" in reader


@pytest.mark.engines
def test_speculators_and_specforge_ids_are_zlab_plus_one():
    """speculators 0.9.0's converter writes aux_hidden_state_layer_ids = z-lab id + 1, and SpecForge 0.2.0's
    (z-lab's) DFlashDraftModel reads hidden_states[id + 1]: the readings eaglewire writes."""
    import zipfile

    from eaglewire.core.presets import cache_dir

    def text(name: str, version: str, path: str) -> str:
        found = sorted((cache_dir() / "engines" / "wheels").glob(f"{name}-{version}-*.whl"))
        if not found:
            pytest.skip(f"{name}=={version}'s wheel is not in the cache (tests/engines/conftest.py PEERS fetches it)")
        return zipfile.ZipFile(found[0]).read(path).decode()

    converter = text("speculators", "0.9.0", "speculators/convert/dflash/converter.py")
    assert "i + 1 for i in target_layer_ids if i + 1 != num_verifier_layers" in converter
    zlab = text("specforge", "0.2.0", "specforge/modeling/draft/dflash.py")
    assert "hidden_states[layer_id + offset]" in zlab and '"target_layer_ids",' in zlab
    assert zlab_layout.to_ids(BOUNDS, L, None) == [1, 3, 5]
    assert vllm.dflash_to_ids(BOUNDS, L, "llama") == BOUNDS
