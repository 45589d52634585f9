"""``eaglewire bench``: config parsing, τ and speedup arithmetic, and a run end to end on a tiny target."""

import json

import pytest
import torch

from eaglewire.bench.bench_command import (BenchConfig, Row, config_label, heldout_prompts, parse_configs, position_acceptance, speedup,
                             tau_per_request, tau_pooled, time_split)
from eaglewire.model.checkpoint import save_draft
from eaglewire.cli import main
from eaglewire.core.generation import GenerationStats
from eaglewire.decode.spec_config import SpecConfig


def stats(accept_lengths, position_accepts=(), seconds=1.0, **kw):
    return GenerationStats(accept_lengths=list(accept_lengths), position_accepts=list(position_accepts),
                           new_tokens=sum(accept_lengths) + 1, total_seconds=seconds, **kw)


# ------------------------------------------------------------------ configs

def test_parse_configs():
    runs = parse_configs(" 1,0,0,0; 1,5,1,6;1,6,4,24;1,5,1,6,0.10")
    assert [config_label(r) for r in runs] == ["1,0,0,0", "1,5,1,6", "1,6,4,24", "1,5,1,6,0.1"]
    assert runs[0] is None
    assert runs[2] == SpecConfig(num_steps=6, topk=4, num_draft_tokens=24)
    assert runs[3].min_prob == 0.1 and runs[1] == SpecConfig.chain(5)


@pytest.mark.parametrize("text, message", [
    ("1,0,0,0;4,5,1,6", "batch 4 is not supported; the engine decodes one sequence at a time, so use batch 1 (1,5,1,6)"),
    ("1,5,1", "is not batch,steps,topk,draft-tokens[,min-prob]"),
    ("1,five,1,6", "is not batch,steps,topk,draft-tokens[,min-prob]"),
    ("1,5,1,6,0.1,2", "is not batch,steps,topk,draft-tokens[,min-prob]"),
    ("1,0,4,8", "steps 0 means no speculation"),
    ("1,0,0,0,0.2", "steps 0 means no speculation"),
    ("1,5,1,5", "config '1,5,1,5' (batch,steps,topk,draft-tokens[,min-prob] (e.g. 1,5,1,6 or 1,5,1,6,0.1)): "
                "--speculative-eagle-topk 1 drafts a chain"),
    ("1,5,1,6,1.5", "--draft-min-prob must be in [0, 1)"),
    ("1,2,2,40", "outside [2, 7]"),
    ("1,5,1,6;1,5,1,6", "given twice"),
    (" ; ", "--configs is empty"),
])
def test_parse_configs_errors(text, message):
    with pytest.raises(ValueError) as e:
        parse_configs(text)
    assert message in str(e.value)


def test_config_errors_say_what_to_give():
    with pytest.raises(ValueError, match="config 1,5,1,6 speculates and needs a draft: give --draft"):
        BenchConfig(configs="1,0,0,0;1,5,1,6")
    with pytest.raises(ValueError, match="sharegpt-heldout .* give --draft"):
        BenchConfig(configs="1,0,0,0", dataset="sharegpt-heldout")
    with pytest.raises(ValueError, match="--compare vllm: unknown baseline; choose from hf, hf-pld"):
        BenchConfig(configs="1,0,0,0", compare=["hf", "vllm"])
    assert str(BenchConfig(configs="1,0,0,0", dataset="data/my prompts.jsonl").out_dir) == "runs/bench/my prompts"


# ------------------------------------------------------------------ metrics

def test_tau_pooled_and_per_request_differ():
    long = stats([4, 4, 4, 4, 4, 4], position_accepts=[6, 6, 6])  # τ 4 over 6 passes
    short = stats([1, 1], position_accepts=[0, 0, 0])  # τ 1 over 2 passes
    assert tau_pooled([long, short]) == pytest.approx(26 / 8)  # long requests weigh more
    assert tau_per_request([long, short]) == pytest.approx(2.5)  # every request weighs the same
    assert position_acceptance([long, short]) == pytest.approx([6 / 8] * 3)
    assert tau_pooled([stats([])]) is None and tau_per_request([stats([]), short]) == 1.0


def test_time_split_and_speedup_relative_to_plain():
    st = stats([1, 1], draft_seconds=0.5, verify_seconds=1.0, prefill_seconds=0.25, seconds=2.0)
    assert time_split([st, st]) == pytest.approx({"draft": 1.0, "verify": 2.0, "prefill": 0.5, "total": 4.0,
                                                  "other": 0.5})
    plain = Row("1,0,0,0", "plain", [stats([1] * 9, seconds=10.0)], [[]])  # 10 tokens in 10 s
    spec = Row("1,5,1,6", "eagle3", [stats([3, 3, 3], seconds=2.5)], [[]])  # 10 tokens in 2.5 s
    hf = Row("hf", "hf", [GenerationStats(new_tokens=10, total_seconds=5.0)], [[]])
    rows = [spec, plain, hf]
    assert [speedup(r, rows) for r in rows] == pytest.approx([4.0, 1.0, 2.0])
    assert speedup(spec, [spec, hf]) is None  # no plain row in this run


def test_heldout_prompts(tmp_path):
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([
        {"id": f"c{i}", "conversations": [{"from": "system", "value": "Be brief."},
                                          {"from": "human", "value": f"question {i}"},
                                          {"from": "gpt", "value": "answer"}]} for i in range(6)]))
    draft_config = {"training": {"data": "sharegpt", "heldout_sequence_ids": ["c4", "c1", "c5"]}}
    prompts = heldout_prompts(draft_config, sharegpt, limit=2)
    assert [(p.id, p.text, p.chat) for p in prompts] == [("c4", "question 4", True), ("c1", "question 1", True)]
    with pytest.raises(ValueError, match="records no held-out conversations"):
        heldout_prompts({"training": {}}, sharegpt)
    with pytest.raises(ValueError, match=r"1 held-out conversation\(s\) .*'c9'.* trained on 'sharegpt'"):
        heldout_prompts({"training": {"data": "sharegpt", "heldout_sequence_ids": ["c1", "c9"]}}, sharegpt)


# ------------------------------------------------------------------ end to end

@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, chat_tiny_target):
    from eaglewire.core.contract import HiddenStateContract
    from eaglewire.model.draft import DraftConfig, Eagle3Draft

    torch.manual_seed(0)
    cfg = DraftConfig.from_target(chat_tiny_target.text_config, num_aux=3, draft_vocab_size=128,
                                  vocab_size=chat_tiny_target.vocab_size)
    contract = HiddenStateContract(aux_boundaries=(2, 4, 5), target=chat_tiny_target.fingerprint)
    return save_draft(tmp_path_factory.mktemp("draft"), Eagle3Draft(cfg), contract)


def write_prompts(path, n):
    path.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": f"Count to {i + 3}.", "chat": True})
                               for i in range(n)))
    return path


def test_bench_end_to_end(tmp_path, target_dir, draft_dir, capsys, one_thread):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3)
    out = tmp_path / "report"
    argv = ["bench", "--target", str(target_dir), "--draft", str(draft_dir), "--dataset", str(prompts),
            "--configs", "1,0,0,0;1,3,1,4;1,3,2,6;1,3,1,4,0.4", "--compare", "hf,hf-pld", "--max-new-tokens", "12",
            "--warmup", "0", "--device", "cpu", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert "τ pooled" in shown and "τ per-request" in shown and "hf-pld" in shown

    report = json.loads((out / "bench.json").read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == ["1,0,0,0", "1,3,1,4", "1,3,2,6", "1,3,1,4,0.4", "hf", "hf-pld"]
    assert report["prompts"] == ["p0", "p1", "p2"]
    plain = rows["1,0,0,0"]
    assert plain["method"] == "plain" and plain["tau_pooled"] == plain["tau_per_request_mean"] == 1.0
    assert plain["speedup"] == 1.0 and plain["position_acceptance"] == []
    for name in ("1,3,1,4", "1,3,2,6", "1,3,1,4,0.4"):
        row = rows[name]
        assert row["same_output_as_plain"] == 3  # greedy speculation is lossless
        assert row["new_tokens"] == plain["new_tokens"] and len(row["position_acceptance"]) == 3
        # τ counts the root and every accepted token of a pass: 1 + the per-depth acceptance shares
        assert row["tau_pooled"] == pytest.approx(1 + sum(row["position_acceptance"]), abs=0.01)
        assert set(row["seconds"]) == {"draft", "verify", "prefill", "other", "total"}
    assert plain["verified_per_pass"] == 1.0 and rows["1,3,1,4"]["verified_per_pass"] == 4.0  # a full chain
    assert 1.0 <= rows["1,3,1,4,0.4"]["verified_per_pass"] < 4.0  # an untrained draft is rarely that sure
    for name in ("hf", "hf-pld"):
        assert rows[name]["tau_pooled"] is None and rows[name]["tokens_per_second"] > 0

    md = (out / "bench.md").read_text()
    assert "eaglewire bench --target" in md and "--compare hf,hf-pld" in md
    assert md.count("\n| ") == 2 + 6  # header, rule, one line per row
    assert "| hf | hf |" in md and "| - | - |" in md  # τ does not apply to HF rows
    for png in ("acceptance.png", "throughput.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The report directory records the resolved config; loaded back with --config it reruns the bench.
    record = json.loads((out / "resolved_config.json").read_text())
    assert record["configs"] == "1,0,0,0;1,3,1,4;1,3,2,6;1,3,1,4,0.4" and record["compare"] == ["hf", "hf-pld"]
    again = tmp_path / "again"
    assert main(["bench", "--config", str(out / "resolved_config.json"), "--out", str(again), "--no-progress"]) == 0
    assert json.loads((again / "resolved_config.json").read_text()) == {**record, "out": str(again)}
    rerun = json.loads((again / "bench.json").read_text())
    assert [r["name"] for r in rerun["rows"]] == list(rows) and rerun["prompts"] == report["prompts"]
    for row in rerun["rows"]:  # greedy: the same tokens
        assert row["new_tokens"] == rows[row["name"]]["new_tokens"], row["name"]


def test_cli_errors_exit_2_with_a_message(tmp_path, capsys):
    assert main(["bench", "--configs", "1,0,0,0;2,5,1,6"]) == 2
    assert "batch 2 is not supported" in capsys.readouterr().err
    assert main(["bench", "--configs", "1,5,1,6"]) == 2
    assert "give --draft DIR" in capsys.readouterr().err


def test_sampling_rows_are_seeded_per_prompt(tmp_path, chat_tiny_target, draft_dir, one_thread):
    from eaglewire.bench.bench_command import run_bench
    from eaglewire.bench.bench_report import to_json

    common = dict(draft=str(draft_dir), dataset=str(write_prompts(tmp_path / "p.jsonl", 2)), max_new_tokens=8,
                  temperature=0.9, warmup=0, seed=3)
    result = run_bench(BenchConfig(configs="1,0,0,0;1,3,2,6", compare=["hf", "hf-pld"], **common),
                       target=chat_tiny_target, progress=False)
    rows = to_json(result)["rows"]
    assert [r["name"] for r in rows] == ["1,0,0,0", "1,3,2,6", "hf", "hf-pld"]
    assert all(r["same_output_as_plain"] is None for r in rows)  # sampled outputs may differ legitimately
    again = run_bench(BenchConfig(configs="1,3,2,6", **common), target=chat_tiny_target, progress=False)
    assert again.rows[0].outputs == result.rows[1].outputs
