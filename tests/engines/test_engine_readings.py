"""eaglewire's engine readings (contract.py) against the engines' own released code.

The id-mapping functions are taken from the pinned wheels with ``ast`` and executed on stub
objects (nothing is installed or imported: both engines need a GPU stack); what a forward
pass captures is read from the AST of the capture sites and compared with a snapshot, so a
release that changes either fails here and names the file to re-read.
"""

from __future__ import annotations

import ast
import itertools
from types import SimpleNamespace
from typing import Any, List, Optional

import pytest

from eaglewire.core.contract import TARGET_ARCHS, ContractError, EngineConventionError
from eaglewire.engines import from_engine, to_engine
from eaglewire.engines.sglang import FILES as SGLANG_FILES
from eaglewire.engines.vllm import FILES as VLLM_FILES
from eaglewire.model.draft import DraftConfig
from eaglewire.engines import sglang as sglang_format
from eaglewire.engines import vllm
from eaglewire.engines.formats import speculators_layout

pytestmark = pytest.mark.engines

L = 30
LAYOUTS = [[2, 15, 27], [0, 15, 27], [1, 15, 27], [3, 16, 28], [2, 15, 30], [0, 2, 15, 30], [1, 3, 5, 7],
           [0, 29, 30], [4, 29]]
HF_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
            "glm4_moe_lite": "Glm4MoeLiteForCausalLM", "gpt_oss": "GptOssForCausalLM"}

# What each SGLang model file's forward does with layers_to_capture (read from its AST):
# the membership tests (``i`` = the input of layer i; anything else = after the last layer)
# and the capture expressions. A change here means: re-read the file, update contract.py.
SGLANG_CAPTURE_SITES = {
    "sglang/srt/models/llama.py": ({"i"}, {"capture_output=aux_hidden_states.capture", "capture=capture_output"}),
    "sglang/srt/models/qwen2.py": ({"i"}, {"capture_output=aux_hidden_states.capture", "capture=capture_output"}),
    "sglang/srt/models/qwen3.py": ({"i"}, {"capture_output=aux_hidden_states.capture", "capture=capture_output"}),
    "sglang/srt/models/glm4_moe_lite.py": ({"i"}, {"capture_output=aux_hidden_states.capture",
                                                   "capture=capture_output"}),
    "sglang/srt/models/deepseek_v2.py": ({"i"}, {"captured_last_layer_outputs=aux_hidden_states",
                                                 "capture_gathered=captured_last_layer_outputs"}),
    # the layer returns (block output, residual) apart and only the first is kept
    "sglang/srt/models/gemma3_causal.py": ({"i", "num_layers"}, {"append(hidden_states)"}),
    "sglang/srt/models/gpt_oss.py": ({"i", "self.end_layer"}, {
        "capture_output=aux_hidden_states.capture", "capture=aux_hidden_states.capture", "capture=capture_output",
        "append(residual_batch.snapshot(hidden_states, forward_batch))"}),
}
# vLLM: the layer index each _maybe_add_hidden_state call passes, or the membership tests.
VLLM_CAPTURE_SITES = {
    "vllm/model_executor/models/llama.py": {"self.start_layer", "idx + 1"},
    "vllm/model_executor/models/qwen2.py": {"self.start_layer", "idx + 1"},
    "vllm/model_executor/models/gpt_oss.py": {"self.start_layer", "i + 1"},
    "vllm/model_executor/models/deepseek_v2.py": {"idx", "self.end_layer"},
}
# boundary each capture site yields, given the layer index it tests (start_layer = 0, one PP rank)
VLLM_SITE_BOUNDARIES = {"self.start_layer": [0], "idx + 1": range(1, L + 1), "i + 1": range(1, L + 1),
                        "idx": range(0, L), "self.end_layer": [L]}


# ---------------------------------------------------------------- reading the wheels

_FOUND: dict[tuple[str, str], tuple[str, ast.ClassDef]] = {}


def find_class(wheel, prefix: str, name: str) -> tuple[str, ast.ClassDef]:
    """The file under ``prefix`` that defines and registers class ``name``."""
    if (prefix, name) not in _FOUND:
        _FOUND[prefix, name] = _find_class(wheel, prefix, name)
    return _FOUND[prefix, name]


def _find_class(wheel, prefix: str, name: str) -> tuple[str, ast.ClassDef]:
    hits = []
    for path in wheel.names(prefix):
        text = wheel.text(path)
        if f"class {name}(" not in text:
            continue
        for node in wheel.tree(path).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                hits.append((path, node, "EntryClass" in text or "_MODELS" in text))
    registered = [h for h in hits if h[2]] or hits
    assert len(registered) >= 1, f"{name} is not defined under {prefix} any more"
    return registered[0][0], registered[0][1]


def _imported(wheel, path: str, name: str) -> str | None:
    for node in wheel.tree(path).body:
        if isinstance(node, ast.ImportFrom) and node.module and any(a.name == name for a in node.names):
            return node.module.replace(".", "/") + ".py"
    return None


def resolve_method(wheel, path: str, cls: ast.ClassDef, method: str) -> tuple[str, str, ast.FunctionDef] | None:
    """(file, class, def) of ``method`` as ``cls`` inherits it, following bases inside the wheel."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == method:
            return path, cls.name, node
    for base in cls.bases:
        name = ast.unparse(base)
        where = path if any(isinstance(n, ast.ClassDef) and n.name == name for n in wheel.tree(path).body) \
            else _imported(wheel, path, name)
        if where is None or where not in wheel.zip.namelist():
            continue
        parent = next((n for n in wheel.tree(where).body if isinstance(n, ast.ClassDef) and n.name == name), None)
        found = parent and resolve_method(wheel, where, parent, method)
        if found:
            return found
    return None


def has_base(wheel, path: str, cls: ast.ClassDef, wanted: str) -> bool:
    for base in cls.bases:
        name = ast.unparse(base)
        if name == wanted:
            return True
        where = path if any(isinstance(n, ast.ClassDef) and n.name == name for n in wheel.tree(path).body) \
            else _imported(wheel, path, name)
        if where and where in wheel.zip.namelist():
            parent = next((n for n in wheel.tree(where).body if isinstance(n, ast.ClassDef) and n.name == name), None)
            if parent is not None and has_base(wheel, where, parent, wanted):
                return True
    return False


def compile_function(node: ast.FunctionDef, **names: Any):
    """The engine's own function, executed from its source (decorators dropped)."""
    node = ast.fix_missing_locations(ast.FunctionDef(name=node.name, args=node.args, body=node.body,
                                                     decorator_list=[], returns=None, type_comment=None,
                                                     type_params=[]))
    namespace = {"Optional": Optional, "List": List, "Any": Any, "logger": SimpleNamespace(info=print), **names}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "<engine>", "exec"), namespace)  # noqa: S102
    return namespace[node.name]


def top_function(wheel, path: str, name: str) -> ast.FunctionDef:
    for node in ast.walk(wheel.tree(path)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    pytest.fail(f"{path} has no function {name} any more: re-read it")


# ---------------------------------------------------------------- SGLang

def sglang_capture_sites(wheel, path: str) -> tuple[set[str], set[str]]:
    lefts, captures = set(), set()
    for n in ast.walk(wheel.tree(path)):
        if isinstance(n, ast.Compare) and any(isinstance(o, ast.In) for o in n.ops) \
                and ast.unparse(n.comparators[0]) == "self.layers_to_capture":
            lefts.add(ast.unparse(n.left))
        if isinstance(n, ast.keyword) and n.arg in ("capture", "capture_output", "captured_last_layer_outputs",
                                                   "capture_gathered"):
            captures.add(f"{n.arg}=" + ast.unparse(n.value).split(" if ")[0])
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "append" \
                and ast.unparse(n.func.value) == "aux_hidden_states":
            captures.add("append(" + ", ".join(ast.unparse(a) for a in n.args) + ")")
    return lefts, captures


def sglang_stub(num_layers: int) -> SimpleNamespace:
    layers = [SimpleNamespace() for _ in range(num_layers)]
    model = SimpleNamespace(layers_to_capture=[], layers=layers)
    model.set_eagle3_layers_to_capture = lambda ids: setattr(model, "layers_to_capture", ids)
    return SimpleNamespace(config=SimpleNamespace(num_hidden_layers=num_layers), model=model,
                           pp_group=SimpleNamespace(is_last_rank=True), capture_aux_hidden_states=False)


def sglang_engine(wheels, arch: str):
    """(captured boundaries for config ids, via SGLang's own code; its model file; whether it
    captures the residual stream)."""
    wheel = wheels["sglang"]
    path, cls = find_class(wheel, "sglang/srt/models/", HF_CLASS[arch])
    resolved = resolve_method(wheel, path, cls, "set_eagle3_layers_to_capture")
    assert resolved, f"{HF_CLASS[arch]} has no set_eagle3_layers_to_capture in SGLang any more"
    file, owner, node = resolved
    lefts, captures = sglang_capture_sites(wheel, file)
    assert file in SGLANG_CAPTURE_SITES, f"SGLang serves {arch} from {file} now: re-read it"
    assert (lefts, captures) == SGLANG_CAPTURE_SITES[file], f"{file}'s capture sites changed: re-read it"
    set_layers = compile_function(node)
    after_last = bool(lefts - {"i"})
    block_output = captures == {"append(hidden_states)"}

    def read(ids: list[int]) -> list[int]:
        stub = sglang_stub(L)
        set_layers(stub, list(ids))
        layers = stub.model.layers_to_capture
        got = sorted({i for i in layers if 0 <= i < L})  # the forward walks the layers in order
        return got + [L] if after_last and L in layers else got

    return read, file, f"{owner}.set_eagle3_layers_to_capture", after_last, block_output


@pytest.mark.parametrize("arch", TARGET_ARCHS)
def test_sglang_model_file_and_rule_are_the_ones_cited(wheels, arch):
    _, file, function, after_last, block_output = sglang_engine(wheels, arch)
    f = SGLANG_FILES[arch]
    assert (f.path, f.function, f.captures_last, f.block_output) == (file, function, after_last, block_output)


@pytest.mark.parametrize("arch", TARGET_ARCHS)
@pytest.mark.parametrize("bounds", LAYOUTS)
def test_sglang_captures_what_eaglewire_exports(wheels, arch, bounds):
    read, *_, block_output = sglang_engine(wheels, arch)
    try:
        ids = to_engine(bounds, L, "sglang", target_arch=arch)
    except EngineConventionError as e:
        # the refusal is right: no id list near the boundaries captures them as residual-stream states
        if block_output:
            assert "without the residual" in str(e) and any(b > 0 for b in bounds)
            return
        near = [range(b - 2, b + 2) for b in bounds]
        hits = [list(c) for c in itertools.product(*near) if read(list(c)) == bounds]
        assert hits == [], f"eaglewire refused {bounds} ({e}) but SGLang captures it from ids {hits[0]}"
        return
    assert read(ids) == bounds
    assert from_engine(ids, L, "sglang", target_arch=arch) == bounds  # import agrees with export


FOREIGN_IDS = [[1, 14, 26], [2, 15, 27], [3, 15, 27], [-1, 1, 14], [0, 14, 26], [0, 1, 14], [1, 14, 29],
               [1, 14, 30], [2, 15, 30], [14, 2, 27], [1, 3, 5, 7], [28, 29, 30]]


@pytest.mark.parametrize("arch", TARGET_ARCHS)
@pytest.mark.parametrize("ids", FOREIGN_IDS)
def test_sglang_reading_of_any_ids_is_the_engines(wheels, arch, ids):
    """import --from sglang and the doctor read a config as SGLang does, or say why not."""
    read, *_ = sglang_engine(wheels, arch)
    engine = read(ids)
    try:
        ours = from_engine(ids, L, "sglang", target_arch=arch)
    except ContractError:
        assert len(engine) != len(ids), f"eaglewire refused ids {ids} that SGLang reads as {engine}"
        return
    assert ours == engine


def test_sglang_reads_the_nested_ids_and_sizes_fc_from_them(wheels):
    wheel = wheels["sglang"]
    resolve = ast.unparse(top_function(wheel, "sglang/srt/model_executor/model_runner_components/"
                                              "spec_aux_hidden_state.py", "_resolve_eagle_aux_hidden_state"))
    assert "eagle_config['eagle_aux_hidden_state_layer_ids']" in resolve  # nested only
    init = next(n for n in ast.walk(wheel.tree("sglang/srt/models/llama_eagle3.py"))
                if isinstance(n, ast.FunctionDef) and n.name == "__init__"
                and "num_aux_hidden_states" in ast.unparse(n))
    first = next(i for i, s in enumerate(init.body) if ast.unparse(s).startswith("self.num_aux_hidden_states ="))
    sizing = init.body[first:first + 2]  # the attribute, then the fallback to the nested ids / 3
    assert ast.unparse(sizing[1].test) == "self.num_aux_hidden_states is None", \
        "llama_eagle3.py sizes fc differently now: re-read it"
    cfg = DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, vocab_size=256, target_hidden_size=64, num_aux=4, draft_vocab_size=256)
    for bounds, ids in (([1, 3, 5, 7], [0, 2, 4, 6]), ([2, 15, 27], [1, 14, 26])):
        config = sglang_format.build_config(cfg, ids, bounds, dtype="bfloat16")
        stub = SimpleNamespace()
        namespace = {"self": stub, "config": SimpleNamespace(**config), "getattr": getattr, "len": len}
        exec(compile(ast.Module(body=sizing, type_ignores=[]), "<sglang fc>", "exec"), namespace)  # noqa: S102
        assert stub.num_aux_hidden_states == len(bounds) == sglang_format.num_aux(config)


# ---------------------------------------------------------------- vLLM

def vllm_engine(wheels, arch: str):
    """(captured boundaries for config ids via vLLM's own code, its model file, or None when
    vLLM serves no EAGLE-3 draft for the target)."""
    wheel = wheels["vllm"]
    path, cls = find_class(wheel, "vllm/model_executor/models/", HF_CLASS[arch])
    if not has_base(wheel, path, cls, "SupportsEagle3"):
        return None, path
    resolved = resolve_method(wheel, path, cls, "forward")
    forward_file = resolved[0] if resolved else path
    model_file = {"qwen3.py": "vllm/model_executor/models/qwen2.py",  # Qwen3Model(Qwen2Model)
                  "mistral.py": "vllm/model_executor/models/llama.py"}.get(forward_file.rsplit("/", 1)[1], forward_file)
    sites = set()
    for n in ast.walk(wheel.tree(model_file)):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "_maybe_add_hidden_state":
            sites.add(ast.unparse(n.args[1]))
        if isinstance(n, ast.Compare) and any(isinstance(o, ast.In) for o in n.ops) \
                and ast.unparse(n.comparators[0]) == "self.aux_hidden_state_layers":
            sites.add(ast.unparse(n.left))
    assert model_file in VLLM_CAPTURE_SITES, f"vLLM serves {arch} from {model_file} now: re-read it"
    assert sites == VLLM_CAPTURE_SITES[model_file], f"{model_file}'s capture sites changed: re-read it"
    reachable = sorted({b for s in sites for b in VLLM_SITE_BOUNDARIES[s]})
    interfaces = "vllm/model_executor/models/interfaces.py"
    mixin = next(n for n in wheel.tree(interfaces).body if isinstance(n, ast.ClassDef) and n.name == "EagleModelMixin")
    set_layers = compile_function(next(n for n in mixin.body if isinstance(n, ast.FunctionDef)
                                       and n.name == "_set_aux_hidden_state_layers"))

    def read(ids: list[int]) -> list[int]:
        stub = SimpleNamespace(_cache_aux_pp_layout=lambda: None)
        set_layers(stub, tuple(ids))
        return [b for b in reachable if b in stub.aux_hidden_state_layers]  # captured in layer order

    return read, model_file


def vllm_config_readers(wheels):
    """vLLM's two config lookups (V2 runner, the default; V1 runner) and its speculators conversion."""
    wheel = wheels["vllm"]
    v2 = compile_function(top_function(wheel, "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py",
                                       "get_eagle3_aux_layers_from_config"))
    v1 = compile_function(top_function(wheel, "vllm/v1/worker/gpu_model_runner.py",
                                       "_get_eagle3_aux_layers_from_config"))
    algos = "vllm/transformers_utils/configs/speculators/algos.py"
    update = compile_function(top_function(wheel, algos, "update_eagle3"))

    def hf_config(config: dict) -> SimpleNamespace:
        if config.get("speculators_model_type"):
            pre = dict(config["transformer_layer_config"])  # SpeculatorsConfig.extract_transformers_pre_trained_config
            update(config_dict=config, pre_trained_config=pre)
            return SimpleNamespace(**pre)
        return SimpleNamespace(**config)

    def ids(config: dict) -> dict[str, tuple | None]:
        spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config(config)))
        return {"v2": v2(spec), "v1": v1(SimpleNamespace(speculative_config=spec))}

    return ids, hf_config


@pytest.mark.parametrize("arch", TARGET_ARCHS)
def test_vllm_support_per_target_is_the_one_cited(wheels, arch):
    read, path = vllm_engine(wheels, arch)
    f = VLLM_FILES[arch]
    if read is None:
        assert f.unsupported and "SupportsEagle3" in f.unsupported
    else:
        assert f.unsupported is None and f.path == path


@pytest.mark.parametrize("arch", TARGET_ARCHS)
@pytest.mark.parametrize("bounds", LAYOUTS)
def test_vllm_captures_what_eaglewire_exports(wheels, arch, bounds):
    read, _ = vllm_engine(wheels, arch)
    try:
        ids = to_engine(bounds, L, "vllm", target_arch=arch)
    except EngineConventionError as e:
        assert read is None and "SupportsEagle3" in str(e)
        return
    assert read(ids) == bounds and read(list(reversed(ids))) == bounds  # sorted, whatever the order
    assert from_engine(ids, L, "vllm", target_arch=arch) == bounds


@pytest.mark.parametrize("arch", [a for a in TARGET_ARCHS if VLLM_FILES[a].unsupported is None])
@pytest.mark.parametrize("ids", FOREIGN_IDS)
def test_vllm_reading_of_any_ids_is_the_engines(wheels, arch, ids):
    read, _ = vllm_engine(wheels, arch)
    engine = read(ids)
    try:
        ours = from_engine(ids, L, "vllm", target_arch=arch)
    except ContractError:
        assert len(engine) != len(ids), f"eaglewire refused ids {ids} that vLLM reads as {engine}"
        return
    assert ours == engine


def _draft_config(num_aux: int) -> DraftConfig:
    return DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, vocab_size=256, target_hidden_size=64, num_aux=num_aux, draft_vocab_size=256)


@pytest.mark.parametrize("bounds", [[2, 15, 27], [0, 15, 30], [1, 3, 5, 7]])
def test_vllm_reads_both_eaglewire_exports_and_sizes_fc(wheels, bounds):
    ids_of, hf_config = vllm_config_readers(wheels)
    read, _ = vllm_engine(wheels, "llama")
    cfg = _draft_config(len(bounds))
    spec_config = speculators_layout.build_config(cfg, bounds, verifier_name="org/t", verifier_architecture="x",
                                                  num_steps=3, dtype="bfloat16")
    assert {k: read(list(v)) for k, v in ids_of(spec_config).items()} == {"v2": bounds, "v1": bounds}
    # fc: vLLM's llama_eagle3.py counts num_aux_hidden_states, else nested eagle_config ids, else 3
    wheel = wheels["vllm"]
    init = next(n for n in ast.walk(wheel.tree("vllm/model_executor/models/llama_eagle3.py"))
                if isinstance(n, ast.If) and ast.unparse(n.test) == "self.use_aux_hidden_state")
    sizing = init.body[:2]
    assert all("num_aux_hidden_states" in ast.unparse(s) for s in sizing), "llama_eagle3.py changed: re-read it"

    def fc_states(config: dict) -> int:
        stub = SimpleNamespace(config=hf_config(config))
        exec(compile(ast.Module(body=sizing, type_ignores=[]), "<vllm fc>", "exec"),  # noqa: S102
             {"self": stub, "getattr": getattr, "len": len})
        return stub.num_aux_hidden_states

    assert fc_states(spec_config) == len(bounds) == vllm.num_aux(spec_config)
    del spec_config["transformer_layer_config"]["num_aux_hidden_states"]
    assert fc_states(spec_config) == 3 == vllm.num_aux(spec_config)  # why eaglewire writes it
    # the SGLang export: vLLM reads its top-level ids, which eaglewire writes for it
    sg_ids = to_engine(bounds, L, "sglang", target_arch="llama") if L not in bounds else None
    if sg_ids is not None:
        sg_config = sglang_format.build_config(cfg, sg_ids, bounds, dtype="bfloat16")
        assert {k: read(list(v)) for k, v in ids_of(sg_config).items()} == {"v2": bounds, "v1": bounds}
        assert fc_states(sg_config) == len(bounds)
        del sg_config["eagle_aux_hidden_state_layer_ids"]  # without them: V1 verbatim (one off), V2 default
        got = ids_of(sg_config)
        assert list(got["v1"]) == sg_ids and got["v2"] is None
        readings = vllm.id_readings(sg_config)
        assert list(readings.values()) == [None, sg_ids]  # the doctor's reader agrees with both runners
