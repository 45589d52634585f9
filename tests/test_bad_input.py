"""Damaged drafts and misnamed configs met by import and the doctor: one ``error:`` line naming the
file and what to do, exit 2, never a traceback (a cut or empty ``model.safetensors``, a
``config.json`` holding a JSON list, ``--engine-config`` given a directory or inline JSON)."""

from __future__ import annotations

import shutil

import pytest

from eaglewire.cli import main


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """A tiny target directory and a vLLM/speculators export of a random draft for it."""
    from tiny import save_random_draft, save_tiny_dir

    from eaglewire.engines import export_draft
    from eaglewire.model.target import load_target

    root = tmp_path_factory.mktemp("bad-input")
    target_dir = save_tiny_dir(root / "target")
    target = load_target(str(target_dir), device="cpu", dtype="fp32")
    native = save_random_draft(root / "native", target)
    export_draft(native, "vllm", root / "vllm", target=target, target_arch="LlamaForCausalLM")
    return root, target_dir, native


def damaged(root, name: str, how: str):
    """A copy of the vLLM export with its weights emptied or cut, or its config a JSON list."""
    copy = root / name
    if not copy.exists():
        shutil.copytree(root / "vllm", copy)
        weights = copy / "model.safetensors"
        if how == "empty":
            weights.write_bytes(b"")
        elif how == "cut":
            weights.write_bytes(weights.read_bytes()[:5000])
        else:
            (copy / "config.json").write_text("[1, 2]\n")
    return copy


def run(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("how,says", [("empty", r"model.safetensors cannot be read .*header too small"),
                                      ("cut", r"model.safetensors cannot be read .*truncated or corrupt"),
                                      ("list", r"config.json holds a JSON list, not an object")])
@pytest.mark.parametrize("command", ["import", "doctor"])
def test_a_damaged_draft_is_one_error_line_naming_the_file(foreign, capsys, how, says, command):
    root, target_dir, _ = foreign
    draft = damaged(root, f"{how}-draft", how)
    argv = (["import", "--from", "vllm", str(draft), "--out", str(root / f"out-{how}"), "--target", str(target_dir)]
            if command == "import" else ["doctor", "--draft", str(draft), "--target", str(target_dir)])
    code, errors = run(argv, capsys)
    assert code == 2 and len(errors) == 1, errors
    assert str(draft) in errors[0]
    import re

    assert re.search(says, errors[0]) and "copy it again, or export it again" in errors[0]
    assert not (root / f"out-{how}").exists()  # nothing half-imported


@pytest.mark.parametrize("given,says", [("dir", "is a directory, not a JSON file"),
                                        ("inline", "reads as inline JSON: write it to a file")])
def test_engine_config_that_is_no_file_names_what_to_pass(foreign, capsys, tmp_path, given, says):
    root, target_dir, native = foreign
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "t1 t2"}, {"role": "assistant", "content": "t3 t4"}]}\n')
    config = str(root / "vllm") if given == "dir" else '{"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}'
    code, errors = run(["doctor", "--draft", str(native), "--target", str(target_dir), "--conversations", str(data),
                        "--engine", "vllm", "--engine-config", config], capsys)
    assert code == 2 and len(errors) == 1, errors
    assert says in errors[0] and "--engine-config the draft's config.json file" in errors[0]
