"""The command line end to end on a tiny target saved as a model directory."""

import json

import pytest

from eaglewire.checkpoint import load_draft, read_draft_config, save_draft
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
    assert "acc 0 (held-out)" in capsys.readouterr().out
    assert read_draft_config(draft)["contract"] == manifest["contract"]


def test_generate_streams_the_same_text_with_and_without_a_draft(tmp_path, chat_tiny_target, target_dir, capsys):
    from eaglewire.contract import HiddenStateContract
    from eaglewire.draft import DraftConfig, Eagle3Draft

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
    from eaglewire.contract import ContractError, HiddenStateContract
    from eaglewire.draft import DraftConfig, Eagle3Draft
    from tiny import tiny_target

    cfg = DraftConfig.from_target(chat_tiny_target.text_config, num_aux=3, draft_vocab_size=100,
                                  vocab_size=chat_tiny_target.vocab_size)
    draft = Eagle3Draft(cfg)
    contract = HiddenStateContract(aux_boundaries=(1, 4, 8), target=chat_tiny_target.fingerprint)
    save_draft(tmp_path / "d", draft, contract, {"note": "x"})
    loaded, loaded_contract, meta = load_draft(tmp_path / "d", target=chat_tiny_target)
    assert loaded_contract == contract and meta["training"] == {"note": "x"}
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


def test_defaults_and_choices_have_one_spelling():
    """Every --target default is presets.DEFAULT_TARGET; export/import choices are the engine registry's."""
    import dataclasses

    from eaglewire.bench import BenchConfig
    from eaglewire.cli import build_parser
    from eaglewire.data.prepare import PrepareConfig
    from eaglewire.doctor import DoctorConfig
    from eaglewire.engines import names as engine_names
    from eaglewire.presets import DEFAULT_TARGET, TARGET_PRESETS
    from eaglewire.quickstart import QuickstartConfig
    from eaglewire.train import TrainConfig

    assert DEFAULT_TARGET in TARGET_PRESETS
    for config in (PrepareConfig, TrainConfig, DoctorConfig, QuickstartConfig, BenchConfig):
        assert {f.name: f.default for f in dataclasses.fields(config)}["target"] == DEFAULT_TARGET, config
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command in ("generate", "contract"):
        assert sub[command].get_default("target") == DEFAULT_TARGET
    flags = {cmd: {a.dest: a for a in sub[cmd]._actions} for cmd in ("export", "import")}
    assert tuple(flags["export"]["to"].choices) == engine_names("export")
    assert tuple(flags["import"]["from_"].choices) == engine_names("import")
