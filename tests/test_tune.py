"""`eaglewire tune`: the simulated rounds are the engine's own, the cost fit recovers a known
model, and the recommendation says plain decoding (and why) when no shape pays."""

import json
from dataclasses import fields

import pytest
import torch

from eaglewire.cli import main
from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
from eaglewire.acceptance.costs import ChainProbe, EngineCosts, PlainProbe, fit_costs, stated_costs
from eaglewire.engines.llamacpp.runtime import draft_stats
from eaglewire.acceptance.recommend import predict, rank, recommend, shapes
from eaglewire.acceptance.speed import SpeedQuery, measure
from eaglewire.acceptance.simulate import Shape, drafted_tokens, greedy_rounds, sampled_rounds, tau
from eaglewire.acceptance.trace import DraftTrace, judge_steps, top_probs, trace_text
from eaglewire.tune.tune_command import TuneConfig
from tiny import tiny_target

from decode.test_spec_decoder import random_draft
from test_bench import draft_dir, write_prompts  # noqa: F401  (fixtures)


def _trace(right, prob=None, prob_top=None, target_prob=None, prompt_len=1) -> DraftTrace:
    right = torch.tensor(right, dtype=torch.bool)  # [S, T]
    ones = torch.ones(right.shape)
    return DraftTrace(prompt_len=prompt_len, right=right,
                      prob=ones if prob is None else torch.tensor(prob, dtype=torch.float),
                      prob_top=ones if prob_top is None else torch.tensor(prob_top, dtype=torch.float),
                      target_prob=right.float() if target_prob is None else torch.tensor(target_prob, dtype=torch.float))


# ------------------------------------------------------------------ pure parts

def test_judge_steps_reads_the_text_two_plus_step_ahead():
    text = torch.tensor([5, 6, 7, 8, 9])
    assert judge_steps(torch.tensor([7, 0, 9, 1]), text, 0).tolist() == [True, False, True, False]
    assert judge_steps(torch.tensor([8, 9, 0]), text, 1).tolist() == [True, True, False]  # past the end: False


def test_top_probs_renormalise_over_the_top_k():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    full, top = top_probs(logits, top_k=2)
    assert full.item() == pytest.approx(0.4) and top.item() == pytest.approx(0.4 / 0.7)


def test_llamacpp_rule_stops_below_p_min_after_computing_that_step():
    trace = _trace([[1], [1], [1]], prob_top=[[0.9], [0.6], [0.2]])
    assert drafted_tokens(trace, 0, Shape(3, 0.5), "llamacpp") == (2, 3)  # the third step ran, fell below
    assert drafted_tokens(trace, 0, Shape(2, 0.5), "llamacpp") == (2, 2)  # n-max reached first
    assert drafted_tokens(trace, 0, Shape(3, 0.95), "llamacpp") == (0, 1)
    assert drafted_tokens(trace, 0, Shape(3, 0.5, n_min=3), "llamacpp") == (0, 3)  # too short: dropped


def test_eaglewire_rule_stops_on_the_path_probability():
    trace = _trace([[1], [1], [1]], prob=[[0.9], [0.6], [0.9]])
    assert drafted_tokens(trace, 0, Shape(3, 0.5), "eaglewire") == (2, 2)  # 0.9, 0.54, 0.486 < 0.5
    assert drafted_tokens(trace, 0, Shape(3, 0.0), "eaglewire") == (3, 2)  # its first token needs no step
    assert drafted_tokens(trace, 0, Shape(3, 0.5), "sglang") == (2, 2)  # SGLang's rule is eaglewire's
    with pytest.raises(ValueError, match="tune knows"):
        drafted_tokens(trace, 0, Shape(3), "tensorrt")


def test_greedy_rounds_move_on_by_accepted_plus_bonus():
    # S=2, T=9, prompt 2: rounds start at root 2 (column 1), ...
    right = [[0, 1, 0, 0, 1, 0, 0, 0, 0],
             [0, 1, 0, 0, 0, 0, 0, 0, 0]]
    got = greedy_rounds(_trace(right, prompt_len=2), Shape(2), "llamacpp")
    # root 2: both right (3 tokens) -> root 5: column 4, one right (2) -> root 7: 7 + 2 >= 8, stop
    assert [r.gained for r in got] == [3, 2] and all(r.drafted == 2 for r in got)
    assert tau(got) == 2.5


def test_sampled_rounds_expect_survival_products():
    trace = _trace([[1, 1, 1, 1], [1, 1, 1, 1]], target_prob=[[0.5] * 4, [0.5] * 4])
    got = sampled_rounds(trace, Shape(2), "llamacpp")
    assert got and all(r.gained == pytest.approx(1 + 0.5 + 0.25) for r in got)


def test_fit_costs_recovers_a_linear_model():
    verify = {2: 0.012, 3: 0.014, 4: 0.015}
    step, fixed = 0.002, 0.001
    chains = [ChainProbe(n=n, rounds=50, decode_seconds=50 * (verify[n + 1] + fixed + n * step),
                         draft_seconds=50 * (fixed + n * step), steps_per_round=n) for n in (1, 2, 3)]
    costs = fit_costs("llamacpp", PlainProbe(tokens=100, decode_seconds=1.0), chains)
    assert costs.draft_step == pytest.approx(step)
    for k, v in verify.items():
        assert costs.verify[k] == pytest.approx(v + fixed)
    assert costs.plain_step == pytest.approx(0.01)
    assert costs.verify[1] == pytest.approx(2 * 0.013 - 0.015)  # extended down from k = 2, 3 (above plain)
    assert costs.round_seconds(3, 2) == pytest.approx(0.015 + 2 * step)


def test_one_slowed_run_does_not_set_the_draft_step():
    chains = [ChainProbe(n=n, rounds=10, decode_seconds=1.0, draft_seconds=10 * (0.001 + n * 0.002), steps_per_round=n)
              for n in range(1, 6)]
    chains[2] = ChainProbe(n=3, rounds=10, decode_seconds=5.0, draft_seconds=10 * 0.2, steps_per_round=3)
    assert fit_costs("llamacpp", PlainProbe(100, 1.0), chains).draft_step == pytest.approx(0.002)


def test_a_draft_step_is_never_free_when_runs_disagree():
    """On a busy machine the longer chain's draft time per round can come out below the shorter one's: the slope is
    then not positive, and a draft step of 0 would make every chain look free; the least time per step is used."""
    chains = [ChainProbe(n=1, rounds=10, decode_seconds=1.0, draft_seconds=10 * 0.004, steps_per_round=1),
              ChainProbe(n=2, rounds=10, decode_seconds=1.0, draft_seconds=10 * 0.003, steps_per_round=2)]
    costs = fit_costs("llamacpp", PlainProbe(100, 1.0), chains)
    assert costs.draft_step == pytest.approx(0.0015)  # 3 ms over 2 steps
    assert any("did not grow" in n for n in costs.notes)
    unread = [ChainProbe(n=n, rounds=10, decode_seconds=1.0, draft_seconds=0.0, steps_per_round=n) for n in (1, 2)]
    assert fit_costs("llamacpp", PlainProbe(100, 1.0), unread).draft_step == 0.0  # no timer read: nothing invented


def test_fit_costs_refuses_empty_probes():
    with pytest.raises(ValueError, match="nothing to time"):
        fit_costs("x", PlainProbe(0, 0.0), [])
    with pytest.raises(ValueError, match="no chain run"):
        fit_costs("x", PlainProbe(10, 1.0), [ChainProbe(1, 0, 0.0, 0.0, 1)])


def test_verify_at_interpolates_and_extends():
    costs = EngineCosts("x", 1.0, {2: 2.0, 4: 3.0}, 0.1)
    assert costs.verify_at(3) == pytest.approx(2.5) and costs.verify_at(6) == pytest.approx(4.0)


def test_stated_costs_and_their_errors():
    costs = stated_costs("sglang", verify_per_token=0.02, draft_step=0.05, max_k=3)
    assert costs.verify[1] == 1.0 and costs.verify[4] == pytest.approx(1.06) and costs.source == "stated"
    with pytest.raises(ValueError, match="draft_step must be >= 0"):
        stated_costs("vllm", verify_per_token=0.0, draft_step=-1, max_k=3)


def test_recommendation_is_plain_with_the_reason_when_no_shape_pays():
    right = [[1, 0] * 10, [0, 1] * 10]  # a draft right half the time at step 0
    trace = _trace(right, prompt_len=1)
    cheap = stated_costs("eaglewire", verify_per_token=0.0, draft_step=0.01, max_k=2)
    dear = stated_costs("eaglewire", verify_per_token=1.5, draft_step=0.5, max_k=2)
    good = recommend(rank([predict(s, [trace], cheap, sampled=False) for s in shapes(2, (0.0,))]), "eaglewire")
    assert not good.choice.shape.plain and good.choice.speedup > 1
    bad = recommend(rank([predict(s, [trace], dear, sampled=False) for s in shapes(2, (0.0,))]), "eaglewire")
    assert bad.choice.shape.plain and bad.best_speculative is not None
    assert "plain decoding" in bad.reason and "would need" in bad.reason
    assert f"{bad.best_speculative.break_even_tau:.2f}" in bad.reason


def test_a_draft_that_accepts_nothing_is_never_recommended():
    trace = _trace([[0] * 12, [0] * 12])
    free = stated_costs("eaglewire", verify_per_token=0.0, draft_step=0.0, max_k=2)
    free.verify = {k: 0.5 for k in free.verify}  # a round "cheaper" than a plain step: noise
    got = recommend(rank([predict(s, [trace], free, sampled=False) for s in shapes(2, (0.0,))]), "eaglewire")
    assert got.choice.shape.plain and "no token accepted" in got.reason


def test_draft_stats_reads_llamacpps_cumulative_line():
    log = ("spec common_specu: statistics     draft-eagle3: #calls(b,g,a) =    1    103    103, #gen drafts =    103, "
           "#acc tokens =    23, dur(b,g,a) = 0.004, 102.799, 0.096 ms\n"
           "spec common_specu: statistics     draft-eagle3: #calls(b,g,a) =    2    206    206, #gen drafts =    206, "
           "#acc tokens =    46, dur(b,g,a) = 0.007, 204.838, 0.188 ms\n")
    assert draft_stats(log) == (206, 204.838) and draft_stats("nothing") is None


# ------------------------------------------------------------------ against the engine

@pytest.mark.parametrize("min_prob", [0.0, 0.3])
@pytest.mark.parametrize("steps", [1, 3])
def test_simulated_rounds_are_the_engines_own(steps, min_prob):
    """A greedy chain walked over the trace of the engine's output accepts and verifies, round by
    round, what eaglewire's engine did."""
    target = tiny_target("llama", initializer_range=0.2, vocab_size=6)
    draft, contract = random_draft(target)
    decoder = SpecDecoder(target, draft, contract, SpecConfig.chain(steps, min_prob=min_prob))
    compared = accepted = 0
    for seed in range(2):
        prompt = torch.randint(0, 6, (6 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        out, stats = decoder.generate(prompt, max_new_tokens=24)
        trace = trace_text(target, draft, list(contract.aux_boundaries), prompt + out, len(prompt), steps=steps)
        got = greedy_rounds(trace, Shape(steps, min_prob), "eaglewire")
        assert len(got) >= 4
        assert [r.gained for r in got] == stats.accept_lengths[:len(got)]
        assert [r.drafted + 1 for r in got] == stats.verified_lengths[:len(got)]
        compared += len(got)
        accepted += sum(r.gained - 1 for r in got)
    assert accepted > 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16: the draft traced in the target's precision
def test_tune_end_to_end_on_a_stated_engine(tmp_path, target_dir, draft_dir, capsys, one_thread, dtype):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 2)
    out = tmp_path / "tune.json"
    argv = ["tune", "--target", str(target_dir), "--draft", str(draft_dir), "--dataset", str(prompts),
            "--offset", "0", "--num-prompts", "2", "--max-new-tokens", "12", "--max-steps", "2", "--engine", "sglang",
            "--costs", "stated", "--draft-cost", "3", "--dtype", dtype, "--out", str(out)]
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert "recommended: plain decoding" in shown  # a draft step dearer than three target steps never pays
    report = json.loads(out.read_text())
    assert report["recommendation"]["shape"]["shape"]["n_max"] == 0
    # SGLang drafts a fixed chain (no probability stop): plain and chains of 1 and 2
    assert len(report["ranked"]) == 1 + 2 and report["costs"]["source"] == "stated"


def test_bench_runs_what_tune_recommends(tmp_path, target_dir, draft_dir, capsys, one_thread):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 4)
    out = tmp_path / "bench"
    argv = ["bench", "--target", str(target_dir), "--draft", str(draft_dir), "--dataset", str(prompts),
            "--num-prompts", "2", "--configs", "recommended", "--max-new-tokens", "10", "--warmup", "0",
            "--device", "cpu", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    tuned = json.loads((out / "tune.json").read_text())
    assert tuned["resolved_config"]["offset"] == 2  # tuned on the prompts after the bench's own
    choice = tuned["recommendation"]["shape"]["bench_config"]
    rows = [r["name"] for r in json.loads((out / "bench.json").read_text())["rows"]]
    assert rows == (["1,0,0,0"] if choice == "1,0,0,0" else ["1,0,0,0", choice])


def test_tune_errors_exit_2(tmp_path, capsys):
    assert main(["tune", "--draft", "x", "--engine", "tensorrt"]) == 2
    assert "tune knows" in capsys.readouterr().err


def test_tune_measures_what_its_flags_say(monkeypatch):
    """Every setting of the speed ranking has a tune flag of its name, defaulting to the library's
    value, and the query tune hands the library carries each flag's value."""
    plain = TuneConfig(draft="x")
    for f in fields(SpeedQuery):
        if f.name != "stated":  # tune's --costs decides it (stated where the engine does not run here)
            value = getattr(plain, f.name)
            assert (tuple(value) if f.name == "p_mins" else value) == getattr(SpeedQuery(), f.name), f.name
    given = dict(engine="sglang", max_new_tokens=9, max_steps=2, p_mins=[0.2], temperature=0.5, seed=3,
                 verify_cost=0.1, draft_cost=0.2)
    assert {f.name for f in fields(SpeedQuery)} == set(given) | {"stated"}
    # --costs stated: the GPU model, whether or not SGLang is installed here
    assert TuneConfig(draft="x", costs="stated", **given).query() == SpeedQuery(**{**given, "p_mins": (0.2,)},
                                                                                stated=True)
    assert not TuneConfig(draft="x").query().stated  # eaglewire's own engine is timed here
    monkeypatch.setattr("eaglewire.engines.sglang.server.find", lambda python=None: None)  # not installed here
    with pytest.raises(ValueError, match="SGLang is not installed: run `eaglewire engines install sglang`"):
        TuneConfig(draft="x", engine="sglang", costs="measured").query()
    note = TuneConfig(draft="x", engine="sglang").measured()[1]  # auto: the stated model, saying why
    assert note.startswith("SGLang is not installed") and note.endswith("ranked with the stated cost model instead")


def test_the_speed_ranking_names_what_it_cannot_time():
    with pytest.raises(ValueError, match="engine 'tensorrt': the speed ranking knows eaglewire, sglang, vllm, llamacpp$"):
        SpeedQuery(engine="tensorrt")
    target = tiny_target("llama", vocab_size=6)
    with pytest.raises(ValueError, match="server=server_setup"):
        measure(SpeedQuery(engine="llamacpp"), target, None, None, [[1, 2]], lambda _: None)
