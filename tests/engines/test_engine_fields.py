"""eaglewire's readings of every computing field, of launch flags and of wrapped targets, against the
engines' released code: the wheel's own default-reading and argument-parsing functions executed on
stub inputs (nothing installed or imported), the rest read from the AST of the cited functions."""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections import defaultdict
from types import SimpleNamespace

import pytest

from eaglewire.engines import sglang, vllm
from eaglewire.engines.serving.launch_flags import parse_flexible
from test_engine_readings import compile_function, top_function

pytestmark = pytest.mark.engines

ALGOS = "vllm/transformers_utils/configs/speculators/algos.py"
STUB_CONFIGS = [
    {},
    {"norm_before_residual": False},
    {"norm_before_residual": True, "norm_before_fc": True, "fc_norm": True, "norm_output": True},
    {"draft_vocab_size": 64, "target_hidden_size": 96},
]


@pytest.mark.parametrize("fields", STUB_CONFIGS)
def test_vllm_speculators_defaults_are_update_eagle3s(wheels, fields):
    """update_eagle3 run from the wheel: a missing norm_before_residual is true, the others false."""
    update = compile_function(top_function(wheels["vllm"], ALGOS, "update_eagle3"))
    layer = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "rms_norm_eps": 1e-5,
             "vocab_size": 256}
    config = {"speculators_model_type": "eagle3", "transformer_layer_config": dict(layer), **fields}
    built = dict(layer)
    update(config_dict=config, pre_trained_config=built)
    ours = vllm.read_served(config)
    assert ours.norms == {k: bool(built[k]) for k in ("norm_before_residual", "norm_before_fc", "fc_norm",
                                                      "norm_output")}
    assert ours.draft_vocab_size == (built["draft_vocab_size"] or built["vocab_size"])  # None -> vocab_size
    assert ours.target_hidden_size == built.get("target_hidden_size", built["hidden_size"])


def _source(wheel, path: str, cls: str, method: str) -> str:
    """The source of ``cls.method`` as defined in ``path`` itself."""
    owner = next(n for n in wheel.tree(path).body if isinstance(n, ast.ClassDef) and n.name == cls)
    return ast.unparse(next(n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == method))


def test_vllm_norm_and_vocab_reading_sites(wheels):
    w = wheels["vllm"]
    path = "vllm/model_executor/models/llama_eagle3.py"
    layer = _source(w, path, "LlamaDecoderLayer", "__init__")
    assert "getattr(config, 'norm_before_residual', False)" in layer  # other formats: missing -> false
    model = _source(w, path, "LlamaModel", "__init__")
    assert "eagle_config.get('norm_before_fc', getattr(self.config, 'norm_before_fc', False))" in model
    logits = _source(w, path, "Eagle3LlamaForCausalLM", "compute_logits")
    assert "targets = base + self.draft_id_to_target_id" in logits  # d2t: offsets
    assert "'t2d' in name" in _source(w, path, "Eagle3LlamaForCausalLM", "load_weights")
    speculative = w.text("vllm/config/speculative.py")
    assert "dtype=self.target_model_config.dtype" in speculative


def test_vllm_method_detection_is_the_path_rule(wheels):
    text = wheels["vllm"].text("vllm/config/speculative.py")
    eagle, eagle3 = text.index('elif "eagle-" in self.draft_model_config.model.lower()'), \
        text.index('elif "eagle3" in self.draft_model_config.model.lower()')
    assert eagle < eagle3 and 'self.method = "draft_model"' in text  # an omitted method starts as draft_model
    assert vllm.detect_method("x/EAGLE-3-draft") == "eagle" and vllm.detect_method("x/eagle3") == "eagle3"


@pytest.mark.parametrize("argv", [
    ["serve", "m", "--speculative_config", '{"method": "eagle3", "num_speculative_tokens": 4}'],
    ["serve", "m", "-sc", '{"method": "eagle3"}'],
    ["serve", "m", "--speculative-config.method", "eagle3", "--speculative-config.num_speculative_tokens", "4"],
    ["serve", "m", "--speculative_config.method=eagle3", "-sc.draft.ids+", "1,2"],
])
def test_vllm_flags_parse_as_flexible_argument_parser_does(wheels, argv):
    """FlexibleArgumentParser.parse_args run from the wheel on a parser with vLLM's spellings."""
    w = wheels["vllm"]
    path = "vllm/utils/argparse_utils.py"
    cls = next(n for n in w.tree(path).body if isinstance(n, ast.ClassDef) and n.name == "FlexibleArgumentParser")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "parse_args")
    hri = compile_function(top_function(w, path, "human_readable_int"), re=re)

    class Stub(argparse.ArgumentParser):
        _search_keyword = None

    parse = compile_function(method, re=re, json=json, sys=sys, defaultdict=defaultdict, Namespace=argparse.Namespace,
                             human_readable_int=hri, ArgumentTypeError=argparse.ArgumentTypeError,
                             FlexibleArgumentParser=Stub, logger=SimpleNamespace(warning=lambda *a: None),
                             super=lambda: super(Stub, parser))
    parser = Stub()
    parser.add_argument("command")
    parser.add_argument("model")
    parser.add_argument("--speculative-config", "-sc", type=json.loads)
    theirs = parse(parser, argv).speculative_config
    ours, _ = parse_flexible(" ".join(f"'{a}'" for a in argv), vllm.FLAG_ALIASES)
    got = ours["--speculative-config"]
    assert (json.loads(got) if isinstance(got, str) else got) == theirs


def test_sglang_residual_d2t_embedding_and_head(wheels):
    w = wheels["sglang"]
    path = "sglang/srt/models/llama_eagle3.py"
    assert "norm_before_residual" not in w.text(path)  # never read: the residual is the un-normed state
    forward = _source(w, path, "LlamaDecoderLayer", "forward")
    assert forward.index("residual = hidden_states") < forward.index("hidden_states = self.hidden_norm(hidden_states)")
    loads = _source(w, path, "LlamaForCausalLMEagle3", "load_weights")
    assert "self.hot_token_id = loaded_weight + torch.arange(loaded_weight.shape[0])" in loads  # offsets
    init = _source(w, path, "LlamaForCausalLMEagle3", "__init__")
    assert "self.load_lm_head_from_target = True" in init and "self.lm_head = self.model.embed_tokens" in init
    worker = w.text("sglang/srt/speculative/eagle_worker_v2.py")
    assert "self.draft_runner.model.set_embed(embed)" in worker


def test_sglang_speculative_flags_and_aliases_are_server_args(wheels):
    text = wheels["sglang"].text("sglang/srt/arg_groups/fields/spec.py")
    fields = {"--" + f.replace("_", "-") for f in re.findall(r"^    (speculative_\w+):", text, re.M)}
    no_cli = {"--speculative-boundary-reduction"} | {"--" + m.replace("_", "-") for m in re.findall(
        r"^    (speculative_\w+): A\[\s*[^\n]*\n\s*Arg\(no_cli=True", text, re.M)}
    assert set(sglang.SPEC_FLAGS) == fields - no_cli
    assert 'aliases=["--speculative-draft-model"]' in text


@pytest.mark.parametrize("key", sorted(vllm.WRAPPER_FILES))
def test_vllm_wrappers_forward_the_ids_where_they_implement_supports_eagle3(wheels, key):
    f = vllm.WRAPPER_FILES[key]
    tree = wheels["vllm"].tree(f.path)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.lower() == key)
    implements = any(ast.unparse(b) == "SupportsEagle3" for b in cls.bases)
    assert implements == (f.unsupported is None), f.path


@pytest.mark.parametrize("key", sorted(sglang.WRAPPER_FILES))
def test_sglang_wrappers_forward_the_ids_where_they_set_layers_to_capture(wheels, key):
    f = sglang.WRAPPER_FILES[key]
    text = wheels["sglang"].text(f.path)
    cls = next(n for n in wheels["sglang"].tree(f.path).body if isinstance(n, ast.ClassDef) and n.name.lower() == key)
    has = any(isinstance(n, ast.FunctionDef) and n.name == "set_eagle3_layers_to_capture" for n in cls.body)
    assert has == (f.unsupported is None or f.block_output), f.path
    if key == "qwen2_5_vlforconditionalgeneration":
        assert "self.model.layers_to_capture = [val + 1 for val in layer_ids]" in text and f.ids == "plus_one"


def test_llamacpp_converter_defaults_are_the_cited_ones():
    from eaglewire.core.presets import cache_dir
    from eaglewire.engines.llamacpp.readings import converter_reads

    path = cache_dir() / "engines" / "llama.cpp-11434" / "conversion" / "llama.py"
    if not path.is_file():
        pytest.skip(f"llama.cpp's source is not at {path} (`eaglewire engines install llamacpp`)")
    text = path.read_text()
    assert 'eagle3_raw_config.get("norm_before_residual", False)' in text
    assert 'eagle3_raw_config.get("norm_before_fc", False)' in text
    assert "data = data + np.arange(data.size, dtype=np.int64)" in text  # offsets -> absolute ids
    got = converter_reads({}, num_layers=30)
    assert got["norm_before_residual"] is False and got["target_layers"] == [2, 15, 27]
