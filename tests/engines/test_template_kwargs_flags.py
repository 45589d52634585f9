"""Each engine's launch default for the chat template's switches (chat_template_kwargs), read as the
pinned releases read it: vLLM 0.33.0's and SGLang 0.5.23's --default-chat-template-kwargs (checked against
their wheels), llama-server's --chat-template-kwargs and --reasoning on|off (build 11434's common/arg.cpp)."""

from __future__ import annotations

import pytest

from eaglewire import engines

OFF, ON = {"enable_thinking": False}, {"enable_thinking": True}


@pytest.mark.parametrize("engine, flags, expected", [
    ("vllm", "vllm serve M --default-chat-template-kwargs '{\"enable_thinking\": false}'", OFF),
    ("vllm", "vllm serve M --default_chat_template_kwargs.enable_thinking false", OFF),  # vLLM's dotted keys
    ("sglang", "python -m sglang.launch_server --default-chat-template-kwargs '{\"enable_thinking\": true}'", ON),
    ("llamacpp", "llama-server -m t.gguf --reasoning off", OFF),
    ("llamacpp", "llama-server -m t.gguf --chat-template-kwargs '{\"enable_thinking\": true}'", ON),
    ("vllm", "vllm serve M", None),
])
def test_each_engine_reads_its_launch_default(engine, flags, expected):
    assert engines.get(engine).linter.launch_template_kwargs(flags) == expected


def test_the_wheels_take_the_flag_the_engine_modules_read(wheels):
    """vLLM 0.33.0 and SGLang 0.5.23 define the launch default eaglewire reads, by that name, read as JSON,
    and let a request's own chat_template_kwargs win over it."""
    vllm, sglang = wheels["vllm"], wheels["sglang"]
    cli = vllm.text("vllm/entrypoints/common/cli_args.py")
    assert "default_chat_template_kwargs: dict[str, Any] | None = None" in cli
    assert 'frontend_kwargs["default_chat_template_kwargs"]["type"] = json.loads' in cli
    assert "return defaults | {k: v for k, v in overrides.items()" in vllm.text("vllm/renderers/params.py")
    fields = sglang.text("sglang/srt/arg_groups/fields/serving.py")
    assert "default_chat_template_kwargs: A[" in fields and "type_parser=json.loads" in fields
    assert "ctk.setdefault(k, v)" in sglang.text("sglang/srt/entrypoints/openai/serving_chat.py")
    for lint in (engines.get("vllm").linter, engines.get("sglang").linter):
        assert lint.template_kwargs_flag == "--default-chat-template-kwargs"  # argparse's spelling of the field




def test_an_unreadable_launch_default_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--default-chat-template-kwargs .* is not a JSON object"):
        engines.get("sglang").linter.launch_template_kwargs("--default-chat-template-kwargs true")


def test_the_fix_is_the_engine_s_own_flag():
    assert engines.get("vllm").linter.template_kwargs_fix(OFF) == \
        "--default-chat-template-kwargs '{\"enable_thinking\": false}'"
    assert engines.get("llamacpp").linter.template_kwargs_fix(OFF) == "--reasoning off"
    assert engines.get("llamacpp").linter.template_kwargs_fix({"x": 1}) == "--chat-template-kwargs '{\"x\": 1}'"
