"""``doctor --concurrency``: the speed check says up to how many concurrent requests the draft pays. The flag's
checks; the verdict on made-up measurements (speculation stops paying at 2, pays everywhere, nowhere); the engines
measured elsewhere; and one doctor run that measures eaglewire's engine at two batch sizes for real."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from eaglewire.concurrency.measurement import ConcurrencyReport, StepCost, predict, schedule_from
from eaglewire.acceptance.recommend import MANY_REQUESTS, Prediction, Recommendation
from eaglewire.acceptance.simulate import Shape
from eaglewire.cli import main
from eaglewire.decode.spec_config import SpecConfig
from eaglewire.doctor import load_check as doctor_concurrency
from eaglewire.doctor.doctor_config import DoctorConfig
from eaglewire.doctor.verdicts import Check, DoctorReport
from eaglewire.engines import get as engine

# ------------------------------------------------------------------ the flag


@pytest.mark.parametrize("levels", [[4, 2], [0, 1, 2], [1, 2, 2], []])
def test_concurrency_takes_ascending_batch_sizes_of_at_least_one(levels):
    with pytest.raises(ValueError, match=r"--concurrency takes ascending batch sizes >= 1 \(e.g. 1,2,4,8\), got"):
        DoctorConfig(draft="d", concurrency=levels)
    assert DoctorConfig(draft="d", concurrency=[1, 2, 4]).concurrency == [1, 2, 4]
    assert DoctorConfig(draft="d").concurrency is None  # one request: the speed check as before


def test_concurrency_is_refused_where_no_speed_check_runs():
    with pytest.raises(ValueError, match="--no-tune turns off"):
        DoctorConfig(draft="d", concurrency=[1, 2], tune=False)
    with pytest.raises(ValueError, match="cannot run with --stored"):
        DoctorConfig(draft="d", concurrency=[1, 2], stored=True, data="shards")


def test_the_command_line_flag_is_checked(capsys):
    assert main(["doctor", "--draft", "runs/none", "--concurrency", "4,2"]) == 2
    assert "--concurrency takes ascending batch sizes >= 1" in capsys.readouterr().err
    assert main(["doctor", "--draft", "runs/none", "--concurrency", "0,2"]) == 2
    assert "got [0, 2]" in capsys.readouterr().err


# ------------------------------------------------------------------ the verdict on made-up measurements

CHAIN3 = SpecConfig.chain(3)
REASON = "chain of 3: predicted 1.80x plain at 1 concurrent request (τ 3.50 against the 1.94 its round costs); " \
         + MANY_REQUESTS


def one_request(n_max: int = 3) -> SimpleNamespace:
    """What ``rank_speed`` says for one request: a chain of ``n_max`` (0: plain) with REASON."""
    choice = Prediction(Shape(n_max), 3.5 if n_max else 1.0, n_max, 0.01, 350.0, 1.8 if n_max else 1.0, 1.94)
    return SimpleNamespace(recommendation=Recommendation(choice, choice, REASON if n_max else "plain decoding: no"),
                           rule=engine("eaglewire").chain_rule, ranked=[choice],
                           costs=SimpleNamespace(source="measured"))


def made_up(speedups: dict[int, float], calls: list):
    """A ``measure_concurrency`` that measures nothing: plain takes 10 ms a step at every batch size, chain 3 (tau
    3.5) a step that makes it ``speedups[batch]`` x plain's tokens/s, every step the same (no noise)."""
    def measure(decoder, prompts, batches, shapes, **kw):
        calls.append((decoder, batches, shapes, kw))
        taus = {"chain 3": 3.5}
        costs = {}
        for b in batches:
            costs[(b, "plain")] = StepCost([0.010] * kw["repeats"])
            costs[(b, "chain 3")] = StepCost([0.010 * 3.5 / speedups[b]] * kw["repeats"])
        predictions = predict(costs, taus, shapes, batches)
        return ConcurrencyReport(costs, taus, predictions, schedule_from(predictions), ["1 threads, torch.float32"])
    return measure


@pytest.fixture
def dflash(chat_tiny_target):
    """A random draft and its contract: the SpecDecoder the check builds, never run (measuring is made up)."""
    from tiny import random_dflash_draft

    return random_dflash_draft(chat_tiny_target)


def judge(monkeypatch, chat_tiny_target, dflash, speedups, levels=(1, 2, 4), n_max=3):
    calls: list = []
    monkeypatch.setattr(doctor_concurrency, "measure_concurrency", made_up(speedups, calls))
    report = DoctorReport(draft="d", target="t")
    config = DoctorConfig(draft="runs/draft", concurrency=list(levels))
    draft, contract = dflash
    check = doctor_concurrency.check_speed_under_load(report, config.settings(doctor_concurrency.LoadSettings),
                                                      chat_tiny_target, draft, contract,
                                                      [[1, 2, 3]], one_request(n_max), ["ranked: ..."])
    return check, report, calls


def test_speculation_that_stops_paying_at_two_requests_is_a_warning_naming_the_schedule(
        monkeypatch, chat_tiny_target, dflash):
    check, report, calls = judge(monkeypatch, chat_tiny_target, dflash, {1: 1.8, 2: 1.3, 4: 0.8})
    (decoder, batches, shapes, kw), = calls
    assert batches == [1, 2, 4] and shapes == [CHAIN3] and decoder.spec == CHAIN3  # tune's one-request choice
    assert kw["repeats"] <= 8 and kw["warmup"] <= 2  # a look, not tune's measurement
    assert check.name == "speed" and check.verdict == "warn"
    assert check.summary == "chain of 3: speculation pays up to 2 concurrent requests here; above that serve plain"
    batch = {line.split(":")[0]: line for line in check.evidence if line.startswith("batch ")}
    assert list(batch) == ["batch 1", "batch 2", "batch 4"]
    assert "chain 3 180.0 tokens/s against plain 100.0 (1.80x, noise ±0.0%): pays" in batch["batch 1"]
    assert "chain 3 320.0 tokens/s against plain 400.0 (0.80x, noise ±0.0%): slower than plain" in batch["batch 4"]
    assert check.evidence[0].startswith("at 1 request: chain of 3: predicted 1.80x") and MANY_REQUESTS not in \
        check.evidence[0]
    assert check.fix == ("eaglewire tune --draft runs/draft --target smollm2-135m --concurrency 1,2,4 --schedule-out "
                         "schedule.json, then eaglewire serve --target smollm2-135m --draft runs/draft --schedule "
                         "schedule.json")
    figures = report.to_dict()["concurrency"]  # the JSON report carries the per-level figures
    assert figures["levels"] == [1, 2, 4] and figures["crossover"] == 2 and figures["shape"] == "chain 3"
    assert [(r["batch"], r["speedup"], r["pays"]) for r in figures["rows"]] == [(1, 1.8, True), (2, 1.3, True),
                                                                                (4, 0.8, False)]
    assert figures["rows"][0]["tokens_per_second"] == 180.0 and figures["rows"][0]["plain_tokens_per_second"] == 100.0


def test_speculation_that_pays_at_every_load_measured_is_ok(monkeypatch, chat_tiny_target, dflash):
    check, report, _ = judge(monkeypatch, chat_tiny_target, dflash, {1: 1.8, 2: 1.5, 4: 1.2, 8: 1.1},
                             levels=(1, 2, 4, 8))
    assert check.verdict == "ok" and check.fix is None
    assert check.summary == "chain of 3: speculation pays at every load measured (up to 8 concurrent requests)"
    assert report.concurrency["crossover"] == -1
    assert any("eaglewire tune --draft runs/draft" in line for line in check.evidence)  # more shapes: tune


def test_speculation_that_pays_at_no_load_measured_says_serve_plain(monkeypatch, chat_tiny_target, dflash):
    check, report, _ = judge(monkeypatch, chat_tiny_target, dflash, {2: 0.9, 4: 0.7}, levels=(2, 4))
    assert check.verdict == "warn" and report.concurrency["crossover"] is None
    assert check.summary == "chain of 3: speculation does not pay at any load measured (2,4): serve plain"
    assert "--concurrency 2,4 --schedule-out schedule.json" in check.fix


def test_a_plain_choice_for_one_request_is_not_measured_under_load(monkeypatch, chat_tiny_target, dflash):
    check, report, calls = judge(monkeypatch, chat_tiny_target, dflash, {}, n_max=0)
    assert calls == [] and check.verdict == "warn"
    assert "speculation does not pay even at 1 request" in check.summary and "serve plain" in check.summary
    assert report.concurrency == {"levels": [1, 2, 4], "measured": False, "shape": None}


def test_one_request_is_the_speed_check_as_before_and_more_are_measured(monkeypatch):
    """_check_speed with tune's ranking made up: no --concurrency, or 1, gives the one-request check unchanged."""
    from eaglewire.doctor.doctor_command import _check_speed

    monkeypatch.setattr("eaglewire.acceptance.speed.rank_speed", lambda *a, **kw: one_request())
    calls: list = []
    monkeypatch.setattr(doctor_concurrency, "check_speed_under_load",
                        lambda *a: calls.append(a) or Check("speed", "ok", "under load"))
    sequences = [SimpleNamespace(prompt_ids=[1, 2, 3])] * 2
    for levels in (None, [1]):
        report = DoctorReport(draft="d", target="t")
        _check_speed(report, DoctorConfig(draft="d", concurrency=levels), None, None, None, sequences)
        (check,) = report.checks
        assert (check.verdict, check.summary) == ("ok", REASON) and not report.concurrency and calls == []
    report = DoctorReport(draft="d", target="t")
    _check_speed(report, DoctorConfig(draft="d", concurrency=[1, 2]), None, None, None, sequences)
    assert [c.summary for c in report.checks] == ["under load"] and len(calls) == 1


@pytest.mark.parametrize("name", ["llamacpp", "vllm"])
def test_an_engine_in_its_own_server_is_measured_under_load_by_tune(monkeypatch, name):
    """llama.cpp's speed check is tune's already; vLLM's stated costs price one request: the load is not measured
    here, the check names the command that measures it, and the one-request check stays as it was."""
    from eaglewire.doctor.doctor_command import _check_speed

    monkeypatch.setattr("eaglewire.acceptance.speed.rank_speed", lambda *a, **kw: one_request())
    sequences = [SimpleNamespace(prompt_ids=[1, 2, 3])] * 2
    report = DoctorReport(draft="d", target="t")
    _check_speed(report, DoctorConfig(draft="runs/draft", engine=name, concurrency=[1, 2, 4]), None, None, None,
                 sequences)
    speed, load = report.checks
    assert speed.name == "speed" and speed.verdict == ("skip" if name == "llamacpp" else "ok")
    assert load.name == "speed under load" and load.verdict == "skip"
    command = f"eaglewire tune --engine {name} --draft runs/draft --concurrency 1,2,4"
    assert f"`{command}`" in load.summary and load.fix == command
    assert report.to_dict()["concurrency"] == {"levels": [1, 2, 4], "measured": False, "engine": name,
                                               "command": command}


# ------------------------------------------------------------------ end to end, measured


@pytest.fixture
def accepted(tmp_path, smollm2_tokenizer):
    """A tiny chat target that writes one token (id 1000) forever, saved as a directory, and a draft that always
    proposes it: every drafted token is accepted (a chain of n yields n + 1 tokens a round), so tune's choice for
    one request is a chain and the doctor has a shape to measure under load. 24 layers against the draft's one make
    a round cost a few plain steps. (target_dir, draft_dir, chats)."""
    import torch

    from eaglewire.core.contract import HiddenStateContract
    from eaglewire.model.checkpoint import save_draft
    from eaglewire.model.draft import DraftConfig, Eagle3Draft
    from tiny import tiny_target

    target = tiny_target("llama", vocab_size=len(smollm2_tokenizer), tokenizer=smollm2_tokenizer, num_layers=24,
                         hidden_size=64, initializer_range=0.2)
    V, H, token = target.vocab_size, 64, 1000
    u = torch.ones(H) / H ** 0.5  # every state leans on u far more than any layer moves it
    with torch.no_grad():
        target.model.model.embed_tokens.weight.add_(1000 * u)
        target.model.lm_head.weight[token] = 10 * u
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    draft = Eagle3Draft(DraftConfig.from_target(target.text_config, num_aux=3, draft_vocab_size=V, vocab_size=V))
    with torch.no_grad():  # the last aux state passed through, its head reading only u
        draft.fc.weight.zero_()
        draft.fc.weight[:, 2 * H:] = torch.eye(H)
        draft.midlayer.self_attn.o_proj.weight.zero_()
        draft.midlayer.mlp.down_proj.weight.zero_()
        draft.lm_head.weight.zero_()
        draft.lm_head.weight[token] = u
    save_draft(tmp_path / "draft", draft, HiddenStateContract(aux_boundaries=(2, 4, 23), target=target.fingerprint))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": p}, {"role": "assistant", "content": f"Here is my answer to: {p} " * 3}]}) + "\n"
        for i, p in enumerate(["Name three primary colors.", "Why is the sky blue?", "What does a CPU do?"])))
    return tmp_path / "target", tmp_path / "draft", chats


def test_doctor_concurrency_measures_eaglewires_engine_at_each_batch_size(tmp_path, accepted, capsys, one_thread):
    target_dir, draft_dir, chats = accepted
    out = tmp_path / "report.json"
    main(["doctor", "--draft", str(draft_dir), "--target", str(target_dir), "--conversations", str(chats),
          "--engine-prompts", "2", "--engine-tokens", "16", "--concurrency", "1,2", "--json", str(out)])
    shown = capsys.readouterr().out
    report = json.loads(out.read_text())
    speed = next(c for c in report["checks"] if c["name"] == "speed")
    assert report["resolved_config"]["concurrency"] == [1, 2]
    figures = report["concurrency"]
    assert figures["measured"] and figures["levels"] == [1, 2], speed  # a chain pays for one request here
    steps = int(figures["shape"].removeprefix("chain "))
    assert figures["tau"] == steps + 1  # measured in the engine: every drafted token accepted
    assert [r["batch"] for r in figures["rows"]] == [1, 2]
    assert all(r["tokens_per_second"] > 0 and r["plain_tokens_per_second"] > 0 and r["ms_per_step"] > 0
               for r in figures["rows"])
    assert [line.split(":")[0] for line in speed["evidence"] if line.startswith("batch ")] == ["batch 1", "batch 2"]
    assert speed["verdict"] in ("ok", "warn") and re.search(r"speculation (pays|does not pay)", speed["summary"])
    assert f"schedule: {figures['schedule']}" in speed["evidence"]
    assert "batch 2: chain" in shown  # the printed report shows them too


def test_a_second_run_reads_the_figures_back_from_the_cache(tmp_path):
    from eaglewire.doctor.cache import Cached, load, store

    figures = {"levels": [1, 2], "measured": True, "crossover": 1, "rows": [{"batch": 1, "speedup": 1.4}]}
    store("key", Cached(before=[], after=[Check("speed", "warn", "chain of 3: ...")], layouts=[], accuracy={},
                        facts={}, extras={"concurrency": figures}, stage_seconds={}, created="now"), root=tmp_path)
    report = DoctorReport(draft="d", target="t")
    load("key", root=tmp_path).restore_after(report)
    assert report.concurrency == figures and report.to_dict()["concurrency"] == figures


def test_sglang_under_load_is_sent_to_the_tune_that_launches_it(monkeypatch):
    """SGLang runs here (its CPU kernels built by `eaglewire engines install sglang`): the doctor's speed check
    prices it with the stated GPU model for one request and sends its load to `eaglewire tune`, which launches it."""
    from eaglewire.doctor.doctor_command import _check_speed

    monkeypatch.setattr("eaglewire.acceptance.speed.rank_speed", lambda *a, **kw: one_request())
    report = DoctorReport(draft="d", target="t")
    _check_speed(report, DoctorConfig(draft="runs/draft", engine="sglang", concurrency=[1, 4]), None, None, None,
                 [SimpleNamespace(prompt_ids=[1, 2, 3])] * 2)
    load = report.checks[-1]
    assert load.name == "speed under load" and load.verdict == "skip"
    assert load.fix == "eaglewire tune --engine sglang --draft runs/draft --concurrency 1,4"
