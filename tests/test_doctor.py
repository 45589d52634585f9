"""The doctor: pure pieces on their own, then the three diagnoses on the real SmolLM2 target
with small drafts trained here on the target's own replies."""

import json

import pytest

from eaglewire.doctor.evidence import judge_sweep, lead_noise, predicts_nothing
from eaglewire.doctor.layouts import candidate_layouts
from eaglewire.doctor.verdicts import Check, DoctorReport
from eaglewire.doctor.checks import check_evidence, misaligned_shift
from eaglewire.doctor.doctor_config import DoctorConfig
from eaglewire.doctor.engine_reading import lint_flags, predicted_tau, read_engine_config

# ------------------------------------------------------------------ pure pieces



def test_misaligned_shift_tells_a_shifted_training_from_reading_ahead():
    n = 10_000
    # A well-trained draft reads somewhat better from the next state (it saw the answer's context).
    assert misaligned_shift(0.31, {-1: 0.24, 1: 0.38}, n) is None
    # Trained on the next position's states: served aligned it collapses, shifted it recovers.
    assert misaligned_shift(0.15, {-1: 0.08, 1: 0.85}, n) == 1
    # Trained on the previous position's states: any clear gain from the earlier state is a shift.
    assert misaligned_shift(0.20, {-1: 0.26, 1: 0.22}, n) == -1
    assert misaligned_shift(0.20, {-1: 0.205, 1: 0.21}, n) is None  # within noise

def test_candidates_include_neighbours_engine_readings_and_windows():
    layouts = candidate_layouts([0, 2, 15], 30, {"vllm": [2, 15, 27]})
    assert layouts[(0, 2, 15)] == ["declared"]
    assert "served by vllm" in layouts[(2, 15, 27)]
    assert "last 3 of [0, 2, 15, 27]" in layouts[(2, 15, 27)]  # the motivating miswiring
    assert "boundary 15 -> 16" in layouts[(0, 2, 16)]
    assert "all +1" in layouts[(1, 3, 16)]
    assert (-1, 1, 14) not in layouts  # boundaries outside [0, L] are not candidates


def test_predicted_tau_of_a_chain():
    assert predicted_tau(0.0, [0.9], 5) == 1.0
    assert predicted_tau(1.0, [1.0], 5) == 6.0
    # 1 + 0.5 + 0.5*0.8 + 0.5*0.8*0.8 (the last cond acc stands in for deeper steps)
    assert predicted_tau(0.5, [0.8], 3) == pytest.approx(1 + 0.5 + 0.4 + 0.32)


def test_sglang_reading_of_ids_in_the_other_convention():
    config = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}
    reading = read_engine_config("sglang", config, 30, [2, 15, 27], "LlamaForCausalLM")
    assert reading.readings == {"sglang 0.5.23 (sglang/srt/models/llama.py)": [3, 16, 28]}
    every = read_engine_config("sglang", config, 30, [2, 15, 27]).readings  # no architecture: every model file
    assert every["sglang 0.5.23 on llama/mistral/qwen2/qwen3 targets"] == [3, 16, 28]
    assert every["sglang 0.5.23 on deepseek_v3/glm4_moe_lite targets"] == [2, 15, 27]


def test_vllm_reading_the_sglang_export_without_top_level_ids_is_one_layer_off_or_default():
    config = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}
    reading = read_engine_config("vllm", config, 30, [2, 15, 27], "llama")
    assert reading.readings == {"vllm 0.33.0 (V2 runner, the default), its default layers": [2, 15, 27],
                                "vllm 0.33.0 (V1 runner)": [1, 14, 26]}
    config["eagle_aux_hidden_state_layer_ids"] = [2, 15, 27]  # what an eaglewire SGLang export adds
    assert read_engine_config("vllm", config, 30, [2, 15, 27], "llama").readings == {"vllm 0.33.0": [2, 15, 27]}


def test_engine_problems_beyond_the_ids():
    four = {"eagle_aux_hidden_state_layer_ids": [1, 3, 5, 7]}
    reading = read_engine_config("vllm", four, 30, [1, 3, 5, 7], "llama")
    assert any("sizes the draft's fc for 3 aux states" in p for p in reading.problems)
    gemma = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}
    reading = read_engine_config("sglang", gemma, 30, [2, 15, 27], "Gemma3ForCausalLM")
    assert any("without the residual" in p for p in reading.problems)
    assert any("SupportsEagle3" in p for p in read_engine_config("vllm", four, 30, [1, 3, 5, 7], "gemma3").problems)


def test_sglang_ignores_top_level_ids_and_falls_back_silently():
    reading = read_engine_config("sglang", {"eagle_aux_hidden_state_layer_ids": [0, 2, 15]}, 30, [0, 2, 15])
    assert list(reading.readings.values()) == [[2, 15, 27]]
    assert "top level" in reading.notes[0] and "falls back" in reading.notes[0]


def test_vllm_reads_top_level_ids_verbatim():
    reading = read_engine_config("vllm", {"eagle_aux_hidden_state_layer_ids": [0, 2, 15]}, 30, [0, 2, 15])
    assert reading.readings == {"vllm 0.33.0": [0, 2, 15]} and reading.problems == []


def test_lint_sglang_flags_it_would_silently_change():
    flags = lint_flags("sglang", "--speculative-algorithm EAGLE3 --speculative-num-steps 5 "
                       "--speculative-eagle-topk 1 --speculative-num-draft-tokens 8", [2, 15, 27], 30)
    assert flags.num_steps == 5
    [(verdict, what, fix)] = flags.problems
    assert verdict == "warn" and "capped the draft" in what and "drafts 5 tokens a round, not the 7" in what
    assert fix.startswith("--speculative-num-steps 7 for a chain of 7")


def test_lint_sglang_the_seeds_num_steps_cap():
    """The seeds' launch: --speculative-num-steps 1 with 16 draft tokens drafts one token a round."""
    flags = lint_flags("sglang", "--speculative-algorithm EAGLE3 --speculative-num-steps 1 "
                       "--speculative-eagle-topk 1 --speculative-num-draft-tokens 16", [2, 15, 27], 30)
    [(verdict, what, fix)] = flags.problems
    assert "capped the draft" in what and "drafts 1 token a round, not the 15" in what
    assert fix.startswith("--speculative-num-steps 15")
    fewer = lint_flags("sglang", "--speculative-algorithm EAGLE3 --speculative-num-steps 5 "
                       "--speculative-eagle-topk 1 --speculative-num-draft-tokens 3", [2, 15, 27], 30)
    [(_, what, fix)] = fewer.problems
    assert "overrides" in what and fix == "--speculative-num-draft-tokens 6"


def test_lint_sglang_boundaries_its_model_file_cannot_capture():
    eagle3 = "--speculative-algorithm EAGLE3 --speculative-num-steps=3"
    flags = lint_flags("sglang", eagle3, [2, 15, 30], 30, "llama")
    assert [v for v, _, _ in flags.problems] == ["fail"] and "boundary 30" in flags.problems[0][2]
    assert lint_flags("sglang", eagle3, [0, 2, 15], 30, "llama").problems == []  # id -1


def test_lint_fails_a_launch_that_runs_no_speculation_or_an_impossible_draft_count():
    [(verdict, what, fix)] = lint_flags("sglang", "--speculative-draft-model-path d --speculative-num-steps 3",
                                        [2, 15, 27], 30).problems
    assert verdict == "fail" and "serves without speculation" in what and fix == "--speculative-algorithm EAGLE3"
    for n in (0, -1, "three", 2.5):
        spec = json.dumps({"method": "eagle3", "model": "d", "num_speculative_tokens": n})
        flags = lint_flags("vllm", f"--speculative-config '{spec}'", [2, 15, 27], 30)
        assert [v for v, _, _ in flags.problems] == ["fail"] and "refuses it at launch" in flags.problems[0][1], n
        assert flags.num_steps is None and '"num_speculative_tokens": 3' in flags.problems[0][2]
    missing = lint_flags("vllm", """--speculative-config '{"method": "eagle3", "model": "d"}'""", [2, 15, 27], 30)
    assert [v for v, _, _ in missing.problems] == ["fail"] and "without it" in missing.problems[0][1]


def test_lint_vllm_method():
    flags = lint_flags("vllm", """--speculative-config '{"method": "eagle", "num_speculative_tokens": 4}'""",
                       [2, 15, 27], 30)
    assert flags.num_steps == 4 and flags.problems[0][0] == "fail" and '"eagle3"' in flags.problems[0][2]


def test_report_exit_code_and_json():
    report = DoctorReport(draft="d", target="t")
    report.add(Check("identity", "ok", "fine"))
    assert report.exit_code == 0 and "PASSED" in report.render()
    report.add(Check("layout sweep", "fail", "wrong layers", ["evidence"], fix="do this"))
    assert report.exit_code == 1
    text = report.render()
    assert "FAIL  layout sweep" in text and "fix: do this" in text and "FAILED: 1 failed" in text
    assert json.loads(json.dumps(report.to_dict()))["ok"] is False


def test_inconclusive_is_neither_passed_nor_failed():
    report = DoctorReport(draft="d", target="t")
    report.add(Check("identity", "ok", "fine"))
    report.add(Check("evidence", "inconclusive", "too little evidence", fix="more"))
    assert (report.status, report.exit_code) == ("inconclusive", 3)
    text = report.render()
    assert "INCONCLUSIVE evidence" in text and "INCONCLUSIVE: 0 failed, 1 inconclusive" in text and "PASSED" not in text
    assert report.to_dict()["ok"] is False and report.to_dict()["status"] == "inconclusive"
    report.add(Check("layout sweep", "fail", "wrong layers"))
    assert (report.status, report.exit_code) == ("failed", 1)


def test_noise_on_a_lead_is_two_binomial_standard_errors():
    assert lead_noise(0.5, 0.5, 1000) == pytest.approx(2 * (0.5 / 1000) ** 0.5)  # 0.045
    assert lead_noise(0.3, 0.3, 1_000_000) == 0.02  # tiny differences never matter
    assert lead_noise(0.3, 0.2, 100) > lead_noise(0.3, 0.2, 10_000)


def test_predicts_nothing_needs_evidence_of_it():
    assert predicts_nothing(0.0, 106)  # the Gemma / Phi-3 drafts: 0 of 106 is known to be < 5%
    assert not predicts_nothing(0.0, 20)  # 0 of 20 could still be a 10% draft
    assert not predicts_nothing(0.3, 1000)


def test_sweep_ranks_nothing_when_every_layout_scores_zero():
    judged = judge_sweep({(2, 4, 5): 0.0, (1, 4, 5): 0.0, (3, 4, 5): 0.0}, [2, 4, 5], 500)
    assert judged.verdict == "inconclusive" and "no layout scores above chance" in judged.summary


def test_sweep_says_within_noise_and_never_calls_a_runner_up_the_best():
    n = 106  # the Gemma draft's one sequence: noise ~±0.14
    behind = judge_sweep({(2, 4, 5): 0.40, (1, 4, 5): 0.45, (3, 4, 5): 0.30}, [2, 4, 5], n)
    assert behind.verdict == "ok" and "within noise of the best" in behind.summary and "[1, 4, 5]" in behind.summary
    assert "is the best" not in behind.summary and behind.best == [1, 4, 5]
    assert f"noise ±{lead_noise(0.40, 0.45, n):.3f}" in behind.evidence[0] and f"{n} judged tokens" in behind.evidence[0]
    ahead = judge_sweep({(2, 4, 5): 0.45, (1, 4, 5): 0.40}, [2, 4, 5], n)
    assert ahead.verdict == "ok" and "within noise of [1, 4, 5]" in ahead.summary
    clear = judge_sweep({(2, 4, 5): 0.45, (1, 4, 5): 0.40}, [2, 4, 5], 100_000)
    assert "is the best of 2 candidates, beyond noise" in clear.summary
    wrong = judge_sweep({(2, 4, 5): 0.20, (1, 4, 5): 0.45}, [2, 4, 5], 1000)
    assert wrong.verdict == "fail" and wrong.best == [1, 4, 5] and "beyond noise" in wrong.summary


def test_too_little_evidence_is_inconclusive_and_says_where_more_comes_from():
    def judge(n, sequences, **kw):
        report = DoctorReport(draft="d", target="t")
        config = DoctorConfig(draft="d", **kw)
        check_evidence(report, n, sequences, {"heldout_sequence_ids": ["x"]}, min_tokens=config.min_tokens,
                       num_sequences=config.num_sequences, max_length=config.max_length,
                       include_training=config.include_training)
        return report.checks[0]

    assert judge(1500, 20).verdict == "ok"
    few = judge(106, 1)  # the source ran out: one held-out sequence
    assert few.verdict == "inconclusive" and "106 judged reply tokens" in few.summary
    assert "the draft recorded 1 held out" in few.fix and "about 10 are needed" in few.fix
    assert "--conversations" in few.fix and "--include-training" in few.fix
    capped = judge(400, 8, num_sequences=8)  # the flag held it back
    assert "raise --num-sequences from 8 to about 20" in capped.fix
    assert judge(400, 8, num_sequences=8, min_tokens=300).verdict == "ok"
    with pytest.raises(ValueError, match="--min-tokens must be >= 1, got 0"):
        DoctorConfig(draft="d", min_tokens=0)


def test_doctor_never_passes_a_draft_that_predicts_nothing(tmp_path, chat_tiny_target):
    """A random draft on a few conversations: the old doctor said OK to its acc@0 0.000 and called
    the declared layout the best of candidates that all scored 0."""
    from eaglewire.doctor import run_doctor
    from tiny import save_random_draft

    target = chat_tiny_target
    save_random_draft(tmp_path / "d", target)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": p}, {"role": "assistant", "content": f"Here is my answer to: {p} " * 3}]}) + "\n"
        for i, p in enumerate(PROMPTS[:6])))
    report = run_doctor(DoctorConfig(draft=str(tmp_path / "d"), conversations=str(chats), engine_prompts=1,
                                     engine_tokens=8), target=target)
    checks = {c.name: c for c in report.checks}
    text = report.render()
    assert checks["speed"].verdict == "warn" and "no token accepted" in checks["speed"].summary  # tune's view
    assert report.exit_code == 1 and report.status == "failed", text
    assert checks["accuracy in isolation"].verdict == "fail" and "predicts nothing" in checks["accuracy in isolation"].summary
    assert checks["layout sweep"].verdict == "inconclusive" and "is the best" not in text
    assert checks["evidence"].verdict == "inconclusive" and "only 6 held-out sequence(s)" in checks["evidence"].fix
    assert checks["alignment"].verdict == "inconclusive"
    assert "OK" not in {c.verdict.upper() for c in report.checks if c.name in ("accuracy in isolation", "layout sweep")}
    assert f"judged tokens {report.facts['judged tokens']:,}" in text and 0 < report.facts["judged tokens"] < 1000


def test_verdicts_are_checked():
    with pytest.raises(ValueError, match="verdict"):
        Check("x", "maybe", "?")


# ------------------------------------------------------------------ real target, trained drafts

PROMPTS = ["Name three primary colors.", "What is the capital of France?", "Write a haiku about rain.",
           "Give me two tips for better sleep.", "What does a CPU do?", "Translate 'good morning' to Spanish.",
           "List the planets closest to the sun.", "Why is the sky blue?", "How do I boil an egg?",
           "What is 12 times 12?", "Suggest a name for a cat.", "What is photosynthesis?"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, smollm2_target):
    """Two drafts on the target's own greedy replies: one reads [0, 2, 15], one [2, 15, 27]."""
    from eaglewire.data.prepare import PrepareConfig, prepare
    from eaglewire.train.loop import train
    from eaglewire.train.train_config import TrainConfig

    root = tmp_path_factory.mktemp("doctor")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": p},
                                                                     {"role": "assistant", "content": "?"}]}) + "\n"
                             for i, p in enumerate(PROMPTS)))
    out = {}
    data = str(chats)
    for name, bounds in (("embed", [0, 2, 15]), ("default", [2, 15, 27])):
        shards = root / f"data-{name}"
        prepare(PrepareConfig(out=str(shards), data=data, aux_boundaries=bounds, max_length=96,
                              regenerate=name == "embed", max_new_tokens=48), target=smollm2_target, progress=False)
        data = str(root / "data-embed" / "regenerated.rank0.jsonl")  # the same replies for both layouts
        draft = root / f"draft-{name}"
        train(TrainConfig(out=str(draft), data=str(shards), ttt_steps=2, draft_vocab_size=1024, epochs=20,
                          lr=3e-3, warmup_steps=5, batch_tokens=1200, val_sequences=1, eval_interval=1000,
                          save_interval=1000, log_interval=1000), target=smollm2_target, progress=False)
        out[name] = (str(draft), str(shards))
    return out


def _doctor(smollm2_target, draft, shards, **kw):
    from eaglewire.doctor import run_doctor

    # 12 short replies give a few hundred judged tokens, enough for these drafts' large effects
    config = DoctorConfig(draft=draft, data=shards, include_training=True, engine_prompts=2, engine_tokens=16,
                          min_tokens=200, **kw)
    report = run_doctor(config, target=smollm2_target)
    return report, {c.name: c for c in report.checks}


@pytest.mark.real
def test_doctor_names_first_k_vs_last_k_miswiring_and_the_fix(tmp_path, trained, smollm2_target):
    """Trained on [0, 2, 15], served [2, 15, 27]: the last three of four captured states."""
    draft, shards = trained["embed"]
    served = tmp_path / "config.json"
    served.write_text(json.dumps({"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [2, 15, 27]}))
    report, checks = _doctor(smollm2_target, draft, shards, engine="vllm", engine_config=str(served))
    assert report.exit_code == 1
    assert checks["engine wiring"].verdict == "fail" and "[2, 15, 27]" in " ".join(checks["engine wiring"].evidence)
    assert "[0, 2, 15]" in checks["engine wiring"].fix
    acc = {tuple(r.layout): r.acc0 for r in report.layouts}
    # the declared layout is the best up to noise (a neighbouring layer reads almost alike) and
    # far better than the served one
    assert acc[(0, 2, 15)] >= max(acc.values()) - 0.02 and acc[(0, 2, 15)] > acc[(2, 15, 27)] + 0.1, acc
    assert checks["layout sweep"].verdict == "fail"


@pytest.mark.real
def test_doctor_catches_an_sglang_vllm_off_by_one(tmp_path, trained, smollm2_target):
    """vLLM-convention ids [2, 15, 27] in a SGLang config: SGLang's llama.py adds 1 -> [3, 16, 28]."""
    draft, shards = trained["default"]
    served = tmp_path / "config.json"
    served.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}))
    report, checks = _doctor(smollm2_target, draft, shards, engine="sglang", engine_config=str(served))
    assert report.exit_code == 1
    wiring = checks["engine wiring"]
    assert wiring.verdict == "fail" and "[3, 16, 28]" in " ".join(wiring.evidence)
    assert "[1, 14, 26]" in wiring.fix  # the ids that wire it right on SmolLM2's model file (llama.py)
    acc = {tuple(r.layout): r.acc0 for r in report.layouts}
    # neighbouring layers can tie on this small, overfit draft (0.8635 both with one thread): never worse
    assert acc[(2, 15, 27)] >= acc[(3, 16, 28)], acc


@pytest.mark.real
def test_doctor_passes_a_correctly_wired_draft(tmp_path, trained, smollm2_target):
    from eaglewire.engines import export_draft

    draft, shards = trained["default"]
    export_draft(draft, "sglang", tmp_path / "sglang")
    report, checks = _doctor(smollm2_target, draft, shards, engine="sglang",
                             engine_config=str(tmp_path / "sglang" / "config.json"),
                             engine_flags="--speculative-algorithm EAGLE3 --speculative-num-steps 3 "
                                          "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4")
    assert report.exit_code == 0, report.render()
    assert {c.verdict for c in report.checks} <= {"ok", "warn"}
    assert checks["capture drift"].verdict == "ok" and checks["layout sweep"].verdict == "ok"
    assert checks["acceptance"].verdict == "ok"
    accuracy = report.to_dict()["accuracy"]  # the isolation figures, machine-readable
    assert list(accuracy) == ["acc@0", "cond acc@1", "cond acc@2"]
    assert f"acc@0 {accuracy['acc@0']:.3f}" in checks["accuracy in isolation"].evidence[0]


def test_launch_flags_parse_as_a_shell_splits_them_for_every_engine():
    from eaglewire.engines.serving.launch_flags import parse_flags

    flags = parse_flags("--speculative-num-steps 3 --speculative-config='{\"a\": 1}' -t 2 --metrics -td 2 --x -1")
    assert flags == {"--speculative-num-steps": "3", "--speculative-config": '{"a": 1}', "-t": "2",
                     "--metrics": "", "-td": "2", "--x": "-1"}


def test_the_launch_cap_is_named_where_a_longer_chain_pays():
    """The seeds' launch drafted 1 token a round where a longer chain paid: named with the chain to launch; no
    warning where the launch is the choice, or the longer chain is within the ranking's margin."""
    from types import SimpleNamespace

    from eaglewire.acceptance.simulate import Shape
    from eaglewire.doctor.doctor_command import launch_cap
    from eaglewire.engines.sglang import CHAIN_RULE

    def ranking(best: int, speeds: dict[int, float]):
        ranked = [SimpleNamespace(shape=Shape(n), tau=1 + 0.3 * n, speedup=v) for n, v in speeds.items()]
        choice = next(p for p in ranked if p.shape.n_max == best)
        return SimpleNamespace(ranked=ranked, rule=CHAIN_RULE, recommendation=SimpleNamespace(choice=choice))

    speeds = {3: 1.6, 1: 1.3, 0: 1.0}
    cap = launch_cap(ranking(3, speeds), 1)
    assert cap.verdict == "warn" and "cap the draft at 1 drafted token a round" in cap.summary
    assert cap.fix == "launch with --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
    assert launch_cap(ranking(3, speeds), 3) is None  # the launch is the choice
    assert launch_cap(ranking(3, {3: 1.31, 1: 1.3, 0: 1.0}), 1) is None  # within the margin
    assert launch_cap(ranking(0, {0: 1.0, 1: 0.9}), 1) is None  # plain is the choice: the speed check says so
