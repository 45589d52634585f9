"""The command line end to end on a tiny target saved as a model directory."""

import json

import pytest
import torch
from safetensors.torch import load_file

from eaglewire.engines import Ability
from eaglewire.model.checkpoint import load_draft, read_draft_config, save_draft
from eaglewire.cli import main


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "chats.json"
    records = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Count to {i}."},
                                                  {"from": "gpt", "value": " ".join(map(str, range(i + 3)))}]}
               for i in range(12)]
    text = json.dumps(records)
    path.write_text(text[:-40])  # cut mid-record, like the shipped ShareGPT file
    return path


def test_prepare_then_train(tmp_path, target_dir, chats, capsys):
    shards = tmp_path / "shards"
    assert main(["prepare", "--target", str(target_dir), "--data", str(chats), "--out", str(shards),
                 "--max-length", "64", "--batch-tokens", "256", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "sequences written        11" in out and "bytes per token" in out
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["contract"]["aux_boundaries"] == [2, 4, 5]
    # Running again resumes: nothing is captured twice.
    assert main(["prepare", "--target", str(target_dir), "--data", str(chats), "--out", str(shards),
                 "--max-length", "64", "--batch-tokens", "256", "--no-progress"]) == 0
    assert "(11 from an earlier run)" in capsys.readouterr().out

    draft = tmp_path / "draft"
    assert main(["train", "--target", str(target_dir), "--data", str(shards), "--out", str(draft),
                 "--ttt-steps", "2", "--draft-vocab-size", "128", "--max-steps", "2", "--batch-tokens", "256",
                 "--val-sequences", "2", "--device", "cpu", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "acc 0 (held-out)" in out and "tokens/s (training steps)" in out
    assert "TFLOP/s (the device's peak is unknown: no MFU)" in out  # a CPU: achieved FLOP/s, no guessed peak
    # the draft's config.json: the data's contract, untouched, with the draft's family
    assert read_draft_config(draft)["contract"] == {**manifest["contract"], "family": "eagle3"}

    # Both run directories record their resolved config, and the record reproduces the run.
    prepared = json.loads((shards / "resolved_config.json").read_text())
    assert prepared["max_length"] == 64 and prepared["data"] == str(chats) and "overwrite" not in prepared
    trained = json.loads((draft / "resolved_config.json").read_text())
    assert trained["ttt_steps"] == 2 and trained["max_steps"] == 2 and "resume" not in trained
    again = tmp_path / "again"
    assert main(["train", "--config", str(draft / "resolved_config.json"), "--out", str(again), "--no-progress"]) == 0
    assert json.loads((again / "resolved_config.json").read_text()) == {**trained, "out": str(again)}
    first, second = (load_file(d / "model.safetensors") for d in (draft, again))
    assert first.keys() == second.keys()
    for name in first:  # the same seeded run; a tolerance, as thread scheduling may reorder kernel sums
        torch.testing.assert_close(first[name], second[name], rtol=1e-4, atol=1e-6, msg=name)


def test_generate_streams_the_same_text_with_and_without_a_draft(tmp_path, chat_tiny_target, target_dir, capsys):
    from eaglewire.core.contract import HiddenStateContract
    from eaglewire.model.draft import DraftConfig, Eagle3Draft

    cfg = DraftConfig.from_target(chat_tiny_target.text_config, num_aux=3, draft_vocab_size=100,
                                  vocab_size=chat_tiny_target.vocab_size)
    save_draft(tmp_path / "d", Eagle3Draft(cfg),
               HiddenStateContract(aux_boundaries=(2, 4, 5), target=chat_tiny_target.fingerprint))
    common = ["generate", "--target", str(target_dir), "--prompt", "Count to 5.", "--chat", "--max-new-tokens", "8",
              "--device", "cpu"]
    assert main(common) == 0
    plain = capsys.readouterr()
    assert "accept length 1.00" in plain.err and "(1.00 tokens verified per pass)" in plain.err
    assert main(common + ["--draft", str(tmp_path / "d"), "--speculative-num-steps", "3", "--speculative-eagle-topk",
                          "1", "--speculative-num-draft-tokens", "4", "--draft-min-prob", "0.2"]) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out and "8 tokens in" in spec.err
    assert main(common + ["--draft", str(tmp_path / "d"), "--draft-min-prob", "1"]) == 2
    assert "--draft-min-prob must be in [0, 1)" in capsys.readouterr().err


def test_user_errors_exit_2_with_a_message(tmp_path, target_dir, capsys):
    assert main(["prepare", "--target", "no-such-model", "--out", str(tmp_path)]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert main(["prepare", "--target", str(target_dir), "--data", str(tmp_path / "missing.json"),
                 "--out", str(tmp_path / "o")]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert main(["prepare", "--target", str(target_dir), "--aux-boundaries", "2,9", "--out", str(tmp_path / "o"),
                 "--data", "x"]) == 2
    assert "outside [0, 8]" in capsys.readouterr().err


def test_contract_command(capsys):
    assert main(["contract", "--num-layers", "30", "--aux-boundaries", "0,3,30"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["vllm"] == [0, 3, 30]  # no --target-arch: every SGLang model file's reading
    assert shown["sglang"]["llama/mistral/qwen2/qwen3"].startswith("not expressible")
    assert shown["sglang"]["gpt_oss"] == [0, 3, 30]
    assert main(["contract", "--num-layers", "30", "--aux-boundaries", "3,16,28", "--target-arch", "llama"]) == 0
    llama = json.loads(capsys.readouterr().out)
    assert main(["contract", "--num-layers", "30", "--aux-boundaries", "3,16,28", "--target-arch", "deepseek_v3"]) == 0
    deepseek = json.loads(capsys.readouterr().out)
    assert (llama["sglang"], deepseek["sglang"]) == ([2, 15, 27], [3, 16, 28])
    assert deepseek["rules"]["sglang"].startswith("sglang/srt/models/deepseek_v2.py")


def test_checkpoint_round_trip_and_foreign_target(tmp_path, chat_tiny_target):
    from eaglewire.core.contract import ContractError, HiddenStateContract
    from eaglewire.model.draft import DraftConfig, Eagle3Draft
    from tiny import tiny_target

    cfg = DraftConfig.from_target(chat_tiny_target.text_config, num_aux=3, draft_vocab_size=100,
                                  vocab_size=chat_tiny_target.vocab_size)
    draft = Eagle3Draft(cfg)
    contract = HiddenStateContract(aux_boundaries=(1, 4, 7), target=chat_tiny_target.fingerprint)
    save_draft(tmp_path / "d", draft, contract, {"note": "x"})
    loaded, loaded_contract, meta = load_draft(tmp_path / "d", target=chat_tiny_target)
    assert loaded_contract == contract.for_family("eagle3") and meta["training"] == {"note": "x"}
    for (name, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        assert a.dtype == b.dtype and (a == b).all(), name
    other = tiny_target("llama", seed=3, vocab_size=chat_tiny_target.vocab_size, tokenizer=chat_tiny_target.tokenizer)
    with pytest.raises(ContractError, match="weights_sha256 recorded"):
        load_draft(tmp_path / "d", target=other)
    with pytest.raises(FileNotFoundError, match="not a draft directory"):
        load_draft(tmp_path)


def test_prepare_with_regenerated_replies(tmp_path, target_dir, chats, capsys):
    out = tmp_path / "regen"
    assert main(["prepare", "--target", str(target_dir), "--data", str(chats), "--out", str(out),
                 "--num-conversations", "3", "--regenerate", "--max-new-tokens", "4", "--max-length", "64",
                 "--batch-tokens", "256", "--no-progress"]) == 0
    regenerated = [json.loads(line) for line in open(out / "regenerated.rank0.jsonl")]
    assert len(regenerated) == 3 and all(r["regenerated"] for r in regenerated)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["regenerated"] is True and manifest["totals"]["sequences"] == 3


def test_prepare_regenerates_only_the_first_turns_when_asked(tmp_path, target_dir):
    chats = tmp_path / "two-turn.json"
    chats.write_text(json.dumps([{"id": f"t{i}", "conversations": [
        {"from": "human", "value": f"Count to {i}."}, {"from": "gpt", "value": "1 2"},
        {"from": "human", "value": "Again."}, {"from": "gpt", "value": "1 2 3"}]} for i in range(3)]))
    out = tmp_path / "regen"
    assert main(["prepare", "--target", str(target_dir), "--data", str(chats), "--out", str(out),
                 "--regenerate", "--max-turns", "1", "--regenerate-batch-size", "2", "--max-new-tokens", "4",
                 "--max-length", "64", "--batch-tokens", "256", "--no-progress"]) == 0
    regenerated = [json.loads(line) for line in open(out / "regenerated.rank0.jsonl")]
    assert [r["num_regenerated_turns"] for r in regenerated] == [1, 1, 1]
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in regenerated)
    assert json.loads((out / "manifest.json").read_text())["source"]["max_turns"] == 1


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, monkeypatch, capsys):
    import eaglewire.data.prepare

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(eaglewire.data.prepare, "prepare", interrupted)
    assert main(["prepare", "--data", "x.json", "--out", str(tmp_path / "d"), "--no-progress"]) == 130
    captured = capsys.readouterr()
    assert captured.err.strip() == "interrupted; run the same command to resume"
    assert "Traceback" not in captured.err + captured.out


def test_sigterm_leaves_through_the_commands_with_blocks_and_exits_143(tmp_path, monkeypatch, capsys):
    """A kill (SIGTERM) of a command that launched a server: its ``with`` block exits (the server stopped, not
    orphaned as it was when the process died around it), one line, exit 143; SIGTERM's handler restored after."""
    import os
    import signal
    from contextlib import contextmanager

    import eaglewire.data.prepare

    stopped = []

    @contextmanager
    def launched_server():
        try:
            yield
        finally:
            stopped.append(True)

    def killed(*a, **k):
        with launched_server():
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("SIGTERM did not reach the command")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(eaglewire.data.prepare, "prepare", killed)
    assert main(["prepare", "--data", "x.json", "--out", str(tmp_path / "d"), "--no-progress"]) == 143
    assert stopped == [True]
    assert capsys.readouterr().err.strip() == "terminated; run the same command to resume"
    assert signal.getsignal(signal.SIGTERM) is before


def test_prepare_rerun_with_other_settings_names_the_fix(tmp_path, target_dir, chats, capsys):
    args = ["prepare", "--target", str(target_dir), "--data", str(chats), "--out", str(tmp_path / "s"),
            "--batch-tokens", "256", "--no-progress"]
    assert main(args + ["--max-length", "64"]) == 0
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["status"]["complete"] is True
    capsys.readouterr()
    assert main(args + ["--max-length", "16"]) == 2
    err = capsys.readouterr().err
    assert "max_length: recorded 64, now 16" in err and "--overwrite" in err
    assert main(args + ["--max-length", "48", "--overwrite"]) == 0
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["source"]["max_length"] == 48


def subcommands():
    import argparse

    from eaglewire.cli import build_parser

    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_defaults_and_choices_have_one_spelling():
    """Every --target default is presets.DEFAULT_TARGET; export/import choices are the formats' own;
    the default reply length is one constant."""
    import dataclasses

    from eaglewire.decode.sampling import MAX_NEW_TOKENS
    from eaglewire.engines import names as engine_names
    from eaglewire.core.presets import DEFAULT_TARGET, TARGET_PRESETS

    assert DEFAULT_TARGET in TARGET_PRESETS
    configs = {name: p.get_default("config_class") for name, p in subcommands().items()}
    for name, config in configs.items():
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        if defaults.get("target", DEFAULT_TARGET) is not dataclasses.MISSING:
            assert defaults.get("target", DEFAULT_TARGET) == DEFAULT_TARGET, name
        if name in ("generate", "bench", "prepare"):
            assert defaults["max_new_tokens"] == MAX_NEW_TOKENS, name
    flags = {cmd: {a.dest: a for a in subcommands()[cmd]._actions} for cmd in ("export", "import")}
    assert tuple(flags["export"]["to"].choices) == engine_names(Ability.EXPORT)
    assert tuple(flags["import"]["from"].choices) == engine_names(Ability.IMPORT)


PREPARE = ["--max-length", "64", "--batch-tokens", "256", "--shard-tokens", "64", "--no-progress"]


def one_error_line(err: str) -> str:
    """stderr of a command that failed as a user error: exactly one ``error:`` line, no traceback."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_second_prepare_into_one_out_is_refused_and_touches_nothing(tmp_path, target_dir, chats, capsys):
    from test_locks import held_elsewhere

    out = tmp_path / "shards"
    out.mkdir()
    (out / "shard-00000.safetensors.tmp").write_bytes(b"being written by the first run")
    with held_elsewhere(out) as pid:
        assert main(["prepare", "--target", str(target_dir), "--data", str(chats), "--out", str(out), *PREPARE]) == 2
        line = one_error_line(capsys.readouterr().err)
    assert f"pid {pid}" in line and str(out) in line
    assert sorted(p.name for p in out.iterdir()) == ["shard-00000.safetensors.tmp"]  # its start-up cleanup did not run


def test_a_full_disk_during_prepare_says_so_and_the_data_resumes(tmp_path, target_dir, chats, capsys, monkeypatch):
    import errno

    import eaglewire.data.shards as shards

    real, written = shards.save_file, []

    def fill_up(tensors, filename, metadata=None):
        if len(written) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(filename)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(shards, "save_file", fill_up)
    out = tmp_path / "shards"
    cmd = ["prepare", "--target", str(target_dir), "--data", str(chats), "--out", str(out), *PREPARE]
    assert main(cmd) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "No space left on device writing" in line and "shard-00002.safetensors.tmp" in line, line
    assert "free some space" in line and "run the same command again to resume" in line
    assert not list(out.glob("*.tmp")) and not (out / ".eaglewire.lock").exists()
    monkeypatch.setattr(shards, "save_file", real)
    assert main(cmd) == 0
    assert "from an earlier run)" in capsys.readouterr().out  # the two shards written before the disk filled
    assert json.loads((out / "manifest.json").read_text())["status"]["complete"] is True


def test_a_read_only_out_is_one_error_line(tmp_path, target_dir, chats, capsys, monkeypatch):
    import errno
    import os

    import eaglewire.core.locks as locks

    def read_only(path, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(locks.os, "open", read_only)  # the first write: the lock file
    out = tmp_path / "ro"
    assert main(["prepare", "--target", str(target_dir), "--data", str(chats), "--out", str(out), *PREPARE]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"Read-only file system writing {out}" in line and "choose a writable directory" in line, line
    monkeypatch.setattr(locks.os, "open", os.open)
    assert not out.exists()  # the lock made it and took it away again


def test_a_truncated_draft_is_one_error_line_naming_the_file(tmp_path, chat_tiny_target, target_dir, capsys):
    from eaglewire.core.contract import HiddenStateContract
    from eaglewire.model.draft import DraftConfig, Eagle3Draft

    cfg = DraftConfig.from_target(chat_tiny_target.text_config, num_aux=3, draft_vocab_size=100,
                                  vocab_size=chat_tiny_target.vocab_size)
    save_draft(tmp_path / "d", Eagle3Draft(cfg),
               HiddenStateContract(aux_boundaries=(2, 4, 5), target=chat_tiny_target.fingerprint))
    weights = tmp_path / "d" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a cut copy
    assert main(["generate", "--target", str(target_dir), "--draft", str(tmp_path / "d"), "--prompt", "hi",
                 "--max-new-tokens", "2", "--device", "cpu"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{weights} cannot be read" in line and "truncated" in line and "incomplete metadata" in line and "copy it again" in line



# ---------------------------------------------------------------- one config per command

def _spec(**kw):
    from eaglewire.decode.spec_config import SpecConfig

    return SpecConfig(**kw)


def _export(**kw):
    from eaglewire.engines import ExportConfig

    return ExportConfig(**kw)


def _remote(**kw):
    from eaglewire.data.remote_regenerate import RemoteConfig

    return RemoteConfig(**kw)


def _sampling(**kw):
    from eaglewire.data.regenerate import RegenerateConfig

    return RegenerateConfig(**kw)


# Per command: a --config file (flag spellings and nested mappings included), the constructor
# arguments it stands for, and flags that override part of it with the arguments they change.
CONFIG_FILES = {
    "prepare": ({"out": "o", "max-length": 64, "batch_tokens": 256}, dict(out="o", max_length=64, batch_tokens=256),
                ["--max-length", "32"], dict(max_length=32)),
    "train": ({"out": "o", "data": "d", "ttt_steps": 2, "aux_boundaries": [1, 2]},
              dict(out="o", data="d", ttt_steps=2, aux_boundaries=[1, 2]), ["--ttt-steps", "3"], dict(ttt_steps=3)),
    "generate": ({"prompt": "hi", "stop": ["\n\n"], "spec": {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}},
                 dict(prompt="hi", stop=["\n\n"], spec=_spec(num_steps=3, topk=1, num_draft_tokens=4)),
                 ["--speculative-num-steps", "2", "--speculative-num-draft-tokens", "3"],
                 dict(spec=_spec(num_steps=2, topk=1, num_draft_tokens=3))),
    "serve": ({"target": "t", "port": 9000, "speculative-eagle-topk": 2}, dict(target="t", port=9000, spec=_spec(topk=2)),
              ["--port", "9001"], dict(port=9001)),
    "quickstart": ({"minutes": 2.5, "bench_configs": "1,0,0,0"}, dict(minutes=2.5, bench_configs="1,0,0,0"),
                   ["--minutes", "1"], dict(minutes=1.0)),
    "doctor": ({"draft": "d", "steps": 2, "tune": False}, dict(draft="d", steps=2, tune=False), ["--tune"], dict(tune=True)),
    "export": ({"draft": "d", "to": "vllm", "out": "o", "num_steps": 3, "export": {"outtype": "f16"}},
               dict(draft="d", to="vllm", out="o", export=_export(num_steps=3, outtype="f16")),
               ["--to", "sglang"], dict(to="sglang")),
    "engines": ({"action": "which", "engine": "llamacpp", "jobs": 3}, dict(action="which", engine="llamacpp", jobs=3),
                ["install"], dict(action="install")),
    "import": ({"src": "s", "from": "eagle", "target": "t", "out": "o"}, dict(src="s", format="eagle", target="t", out="o"),
               ["--from", "sglang"], dict(format="sglang")),
    "import-data": ({"src": "s", "from": "vllm", "out": "o", "target": "t", "dtype": "fp16"},
                    dict(src="s", layout="vllm", out="o", target="t", dtype="fp16"), ["--dtype", "bf16"], dict(dtype="bf16")),
    "bench": ({"max_new_tokens": 12, "configs": "1,0,0,0", "compare": ["hf"]},
              dict(max_new_tokens=12, configs="1,0,0,0", compare=["hf"]), ["--max-new-tokens", "7"], dict(max_new_tokens=7)),
    "tune": ({"draft": "d", "num_prompts": 3, "p_mins": [0, 0.25]}, dict(draft="d", num_prompts=3, p_mins=[0.0, 0.25]),
             ["--num-prompts", "4"], dict(num_prompts=4)),
    "contract": ({"num_layers": 30, "aux_boundaries": "3,16,28"}, dict(num_layers=30, aux_boundaries=[3, 16, 28]),
                 ["--num-layers", "31"], dict(num_layers=31)),
    "regenerate": ({"out": "o.jsonl", "server": "http://a:1,http://b:2", "max_new_tokens": 12},
                   dict(out="o.jsonl", remote=_remote(server=["http://a:1", "http://b:2"]),
                        sampling=_sampling(max_new_tokens=12)),
                   ["--concurrency", "3"], dict(remote=_remote(server=["http://a:1", "http://b:2"], concurrency=3))),
}


def test_every_subcommand_takes_a_config_file_and_its_flags_come_from_its_dataclass(monkeypatch):
    """A subcommand without --config, a flag that is not a field of its config, or a field without
    its flag and help in --help fails here; so does a subcommand missing from CONFIG_FILES."""
    from eaglewire.core.configs import CONFIG_DEST, _leaves

    monkeypatch.setenv("COLUMNS", "100000")  # --help on one line per flag: argparse wraps at hyphens

    sub = subcommands()
    assert set(sub) == set(CONFIG_FILES)
    for name, parser in sub.items():
        config = parser.get_default("config_class")
        assert config is not None, f"{name} has no config dataclass"
        assert "--config" in {s for a in parser._actions for s in a.option_strings}, name
        actions = {a.dest: a for a in parser._actions}
        settings = {s.dest: s for _, s in _leaves(config)}
        assert set(actions) - set(settings) <= {"help", CONFIG_DEST, "no_progress"}, name  # nothing hand-written
        text = parser.format_help()
        for dest, s in settings.items():
            action = actions[dest]
            assert action.help.startswith(s.field.metadata.get("help", "")), (name, dest)
            shown = action.option_strings[0] if action.option_strings else action.metavar
            assert shown == s.flag or not s.flag.startswith("--"), (name, dest)
            assert f"{shown}" in text and action.help.replace("%%", "%") in text, (name, dest)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
@pytest.mark.parametrize("command", sorted(CONFIG_FILES))
def test_a_config_file_sets_the_settings_and_a_flag_overrides_it(tmp_path, command, suffix):
    import yaml

    from eaglewire.cli import build_parser
    from eaglewire.core.configs import config_from_args

    values, kwargs, override, changed = CONFIG_FILES[command]
    path = tmp_path / f"run{suffix}"
    path.write_text(json.dumps(values) if suffix == ".json" else yaml.safe_dump(values))
    cls = subcommands()[command].get_default("config_class")
    parse = lambda *argv: config_from_args(cls, build_parser().parse_args([command, "--config", str(path), *argv]))
    assert parse() == cls(**kwargs)
    assert parse(*override) == cls(**{**kwargs, **changed})


def test_config_files_on_the_command_line(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("num_layers: 30\naux-boundaries: [3, 16, 28]\ntarget_arch: llama\n")
    assert main(["contract", "--config", str(tmp_path / "c.yaml")]) == 0
    assert json.loads(capsys.readouterr().out)["sglang"] == [2, 15, 27]
    assert main(["contract", "--config", str(tmp_path / "c.yaml"), "--target-arch", "deepseek_v3"]) == 0
    assert json.loads(capsys.readouterr().out)["sglang"] == [3, 16, 28]  # the flag wins over the file
    (tmp_path / "bad.yaml").write_text("num_layers: thirty\n")
    assert main(["contract", "--config", str(tmp_path / "bad.yaml")]) == 2
    assert "bad.yaml: num_layers must be an integer or null, got 'thirty'" in capsys.readouterr().err
    (tmp_path / "typo.json").write_text(json.dumps({"num_layer": 30}))
    assert main(["contract", "--config", str(tmp_path / "typo.json")]) == 2
    assert "unknown key 'num_layer'; did you mean num_layers?" in capsys.readouterr().err
    assert main(["export", "--to", "vllm"]) == 2
    assert "missing --draft, --out" in capsys.readouterr().err


def test_export_is_one_library_call_with_the_config(monkeypatch, capsys):
    """cmd_export builds its config and calls engines.export_draft once, llama.cpp included
    (it used to dispatch llamacpp itself)."""
    import eaglewire.engines

    calls = []

    class Report:
        def summary(self) -> str:
            return "exported"

    monkeypatch.setattr(eaglewire.engines, "export_draft", lambda *a, **k: calls.append((a, k)) or Report())
    assert main(["export", "--draft", "d", "--to", "llamacpp", "--out", "o", "--outtype", "f16",
                 "--target-outtype", "none", "--allow-target-mismatch", "weights_sha256"]) == 0
    assert capsys.readouterr().out.strip() == "exported"
    assert calls == [(("d", "llamacpp", "o"), dict(target_arch=None, verifier_name=None, num_steps=5,
                                                    allow={"weights_sha256"}, outtype="f16", target_outtype="none",
                                                    llamacpp_dir=None, threads=2, target_path=None))]
    assert main(["export", "--draft", "d", "--to", "llamacpp", "--out", "o", "--outtype", "q4"]) == 2
    assert "--outtype 'q4' is not one of q8_0" in capsys.readouterr().err


def test_parsing_any_command_imports_no_web_framework():
    """Only `serve` needs fastapi/uvicorn: on a GPU machine whose fastapi could not import (fastapi 0.165 without
    opentelemetry), `train` died at parse time, since building the parser imported the server."""
    import subprocess
    import sys

    code = ("import sys\n"
            "for name in ('fastapi', 'uvicorn', 'starlette'):\n"
            "    sys.modules[name] = None  # importing it raises ImportError\n"
            "from eaglewire.cli import build_parser\n"
            "args = build_parser().parse_args(['train', '--data', 'd', '--out', 'o'])\n"
            "assert args.command == 'train'\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
