"""The quickstart pipeline end to end on a tiny target; a re-run reuses finished stages."""

import json

import pytest

from eaglewire.quickstart import QuickstartConfig, run_quickstart


@pytest.fixture()
def inputs(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
        {"role": "assistant", "content": "placeholder"}]}) + "\n" for i in range(10)))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {w}."}) + "\n" for w in ("hello", "goodbye")))
    return chats, prompts


def test_quickstart_runs_every_stage_and_reuses_them(tmp_path, inputs, chat_tiny_target, monkeypatch):
    chats, prompts = inputs
    config = QuickstartConfig(out=str(tmp_path / "qs"), data=str(chats), num_conversations=10, max_length=64,
                              max_new_tokens=6, minutes=0.05, draft_vocab_size=512, bench_dataset=str(prompts),
                              bench_prompts=2, bench_tokens=4, bench_configs="1,0,0,0;1,2,1,3")
    done = run_quickstart(config, target=chat_tiny_target, progress=False)
    out = tmp_path / "qs"
    assert done["prepare"]["sequences"] == 10
    assert done["train"]["steps"] >= 1
    assert set(done["doctor"]["verdicts"]) >= {"identity", "layout sweep", "capture drift", "acceptance"}
    assert [r["name"] for r in done["bench"]] == ["1,0,0,0", "1,2,1,3"]
    for name in ("stages.json", "summary.md", "doctor.txt", "doctor.json", "bench/bench.md", "draft/config.json"):
        assert (out / name).is_file(), name
    assert "bench 1,2,1,3" in (out / "summary.md").read_text()

    import eaglewire.train

    def no_retraining(*a, **k):
        raise AssertionError("a finished stage ran again")

    monkeypatch.setattr(eaglewire.train, "train", no_retraining)
    assert run_quickstart(config, target=chat_tiny_target, progress=False)["train"] == done["train"]


def test_quickstart_refuses_a_folder_with_other_settings(tmp_path, inputs, chat_tiny_target):
    out = tmp_path / "qs"
    out.mkdir()
    (out / "stages.json").write_text(json.dumps({"config": {"minutes": 99}}))
    with pytest.raises(ValueError, match="other settings"):
        run_quickstart(QuickstartConfig(out=str(out)), target=chat_tiny_target, progress=False)
