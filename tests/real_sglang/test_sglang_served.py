"""The real SGLang serving the reference EAGLE-3 draft on SmolLM2, four server starts for the module, one at a time:
plain; the export as written (a chain of 3); the export with the seeds' fault in its config (the ids written as
the trained boundaries, so SGLang's model file captures one layer on); and the seeds' launch flags
(``--speculative-num-steps 1 --speculative-num-draft-tokens 16``).

(a) greedy outputs with the draft are SGLang's plain outputs on 12 MT-bench prompts, up to bf16 near-ties; (b) the τ SGLang reports per
request is the doctor's replay of the same draft on its text; (c) the doctor against each running server, its flags
read from the server: the seeds' ids FAIL with the ids and the fix, the flags' cap is named, the export PASSES.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from eaglewire.core.machine import cpu
from eaglewire.engines import export_draft
from eaglewire.engines.interface import RunSettings, ServedFiles, Shape

pytestmark = [pytest.mark.sglang, pytest.mark.real]

NEW_TOKENS = 48
CHAIN = 3
PROMPTS = 12
TRAINED = [2, 15, 27]  # the reference draft's boundaries
SGLANG_IDS = [1, 14, 26]  # what SGLang's llama.py captures them from (boundary = id + 1)
SEEDS_IDS = TRAINED  # the seeds' fault: the boundaries written as ids, so SGLang captures [3, 16, 28]
CAP_FLAGS = ("--speculative-num-steps", "1", "--speculative-num-draft-tokens", "16")  # the seeds' launch


@pytest.fixture(scope="module", autouse=True)
def installed(sglang_installation):
    """Skip before any other fixture loads the target, where SGLang is absent."""
    return sglang_installation


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    from eaglewire.core.prompts import load_prompts
    from eaglewire.decode.text import encode_prompt

    return [encode_prompt(smollm2_tokenizer, p.text, chat=p.chat) for p in load_prompts("mt-bench", limit=PROMPTS)]


@pytest.fixture(scope="module")
def served_files(tmp_path_factory, sglang_installation):
    from eaglewire.engines.sglang.server import RUNTIME

    work = tmp_path_factory.mktemp("sglang")
    files = RUNTIME.files("reference", "smollm2-135m", work, RunSettings(install=str(sglang_installation.python)),
                          export=export_draft)
    return work, files


def _serve(installation, files: ServedFiles, shape: Shape, log: Path, work, flags=()):
    """Start, run ``work(server)``, stop; (its result, the launch record), after checking no process is left and
    the all-reduce segment it made in /dev/shm (258 MiB, which SGLang never unlinks) is gone."""
    from eaglewire.engines.serving.server_process import group_alive
    from eaglewire.engines.sglang.server import SglangServer, shm_segments

    with SglangServer(installation, files, shape, threads=2, log_path=log, flags=flags) as server:
        pgid = server.process.proc.pid
        record = server.record
        record["shm_segments"] = [p.name for p in shm_segments(server.shm_port)]
        result = work(server)
    assert not group_alive(pgid), f"SGLang's processes (group {pgid}) outlived the server: see {log}"
    assert not shm_segments(server.shm_port), f"the server's /dev/shm segments outlived it: {record['shm_segments']}"
    return result, record


def _doctor(url: str, out: Path, *, tune: bool = False, flags: str | None = None) -> tuple[int, dict, float]:
    """``eaglewire doctor`` against the running server, its flags read from it or ``flags`` (the user's launch
    line); ``tune``: with its speed check. (exit code, the JSON report, seconds)."""
    from eaglewire.cli import main

    start = time.perf_counter()
    code = main(["--threads", "2", "doctor", "--draft", "reference", "--target", "smollm2-135m", "--engine", "sglang",
                 "--engine-url", url, "--engine-prompts", "4", "--engine-tokens", "32", "--num-sequences", "8",
                 "--min-tokens", "600", "--probe-tokens", "0", "--tune" if tune else "--no-tune", "--json", str(out),
                 *(["--engine-flags", flags] if flags else [])])
    return code, json.loads(out.read_text()), time.perf_counter() - start


def _checks(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def _regenerate(url: str, tokenizer, out: Path):
    """Two conversations' replies regenerated through SGLang's OpenAI API (``eaglewire regenerate --server``)."""
    from eaglewire.data.conversations import Conversation
    from eaglewire.data.regenerate import RegenerateConfig
    from eaglewire.data.remote_regenerate import RemoteConfig, regenerate_remote

    conversations = [Conversation(id=str(i), messages=[{"role": "user", "content": f"What is {i} plus {i}?"},
                                                      {"role": "assistant", "content": "old reply"}])
                     for i in range(2)]
    return regenerate_remote(conversations, out, tokenizer=tokenizer, urls=[url], target="smollm2-135m",
                             config=RegenerateConfig(max_new_tokens=12, max_prompt_tokens=400),
                             remote=RemoteConfig(concurrency=2))


@pytest.fixture(scope="module")
def plain(sglang_installation, served_files, prompts, smollm2_tokenizer):
    work, files = served_files

    def work_on(server):
        answers = [server.generate(p, max_new_tokens=NEW_TOKENS, temperature=0.0, seed=0) for p in prompts]
        return answers, _regenerate(server.url, smollm2_tokenizer, work / "regenerated.jsonl")

    (answers, regenerated), record = _serve(sglang_installation, ServedFiles(target=files.target, draft=None),
                                            Shape(), work / "plain.log", work_on)
    return answers, record, regenerated


@pytest.fixture(scope="module")
def drafted(sglang_installation, served_files, prompts, tmp_path_factory):
    """The export as written: SGLang's own counts on the 12 prompts, one request's stats, and the doctor."""
    from eaglewire.engines.sglang import measure_served

    work, files = served_files

    def work_on(server):
        counts = measure_served(server.url, prompts, max_new_tokens=NEW_TOKENS)
        answer = server.generate(prompts[0], max_new_tokens=NEW_TOKENS, temperature=0.0, seed=0)
        return counts, answer, server.draft_totals(), _doctor(server.url, work / "doctor-export.json")

    return _serve(sglang_installation, files, Shape(n_max=CHAIN), work / "eagle3.log", work_on)


@pytest.fixture(scope="module")
def seeds_ids(sglang_installation, served_files, prompts):
    """The seeds' ids in the served config: the doctor, and SGLang's counts on 4 prompts."""
    from eaglewire.engines.sglang import measure_served

    work, files = served_files
    bad = work / "sglang-export-seeds"
    shutil.copytree(files.draft, bad)
    config = json.loads((bad / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == SGLANG_IDS
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = SEEDS_IDS
    (bad / "config.json").write_text(json.dumps(config, indent=2))

    def work_on(server):
        return measure_served(server.url, prompts[:4], max_new_tokens=NEW_TOKENS), \
            _doctor(server.url, work / "doctor-seeds.json")

    (counts, doctor), _ = _serve(sglang_installation, ServedFiles(target=files.target, draft=bad),
                                 Shape(n_max=CHAIN), work / "seeds.log", work_on)
    return bad, counts, doctor


@pytest.fixture(scope="module")
def capped(sglang_installation, served_files):
    """The seeds' launch flags on the export as written: what the server says it runs, the doctor on the flags it
    reports, and the doctor given the launch line itself."""
    from eaglewire.engines.sglang.server import server_info

    work, files = served_files
    line = (f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {files.draft} --speculative-eagle-topk 1 "
            + " ".join(CAP_FLAGS))

    def work_on(server):
        return (server_info(server.url), _doctor(server.url, work / "doctor-capped.json", tune=True),
                _doctor(server.url, work / "doctor-capped-line.json", flags=line))

    (info, reported, given), _ = _serve(sglang_installation, files, Shape(n_max=CHAIN), work / "capped.log", work_on,
                                        flags=CAP_FLAGS)
    return info, reported, given


def test_plain_serving_counts_one_token_a_round(served_files, plain):
    _, files = served_files
    answers, record, _ = plain
    assert files.family == "eagle3" and files.target.name.startswith("SmolLM2-135M")
    assert all(len(a.tokens) == NEW_TOKENS or a.stats.finish_reason == "stop" for a in answers)
    assert all(a.stats.accept_lengths == [1] * (len(a.tokens) - 1) for a in answers)
    assert all(0 < a.stats.prefill_seconds < a.stats.total_seconds for a in answers)
    assert record["cpus"] == "0-1" and "sglang.launch_server" in " ".join(record["command"])
    # one rank's all-reduce buffer, named by the launch (and removed), where SGLang makes one: a CPU with AMX
    # (srt/distributed/bootstrap.py); none on an AVX-512 CPU without it
    assert len(record["shm_segments"]) == (1 if "amx_tile" in cpu()[1] else 0), record["shm_segments"]


def test_replies_regenerate_through_sglangs_openai_api(served_files, plain):
    from eaglewire.data.remote_regenerate import read_meta

    work, _ = served_files
    _, _, report = plain
    assert report.turns_regenerated == 2
    probes = read_meta(work / "regenerated.jsonl")["probes"]
    assert probes and probes[0]["usage_prompt_tokens"] == probes[0]["prompt_tokens"]  # SGLang tokenizes as we do


BF16_TIE = 0.5  # fp32 logits this close to the top may be ordered either way by SGLang's bf16 passes (see below)


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _below_top(target, prompt: list[int], prefix: list[int], tokens: tuple[int, ...]) -> list[float]:
    """How far below the fp32 target's top logit each of ``tokens`` is, after ``prompt + prefix``."""
    import torch

    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + prefix])).logits[0, -1].float()  # [V]
    top = float(logits.max())
    return [round(top - float(logits[t]), 3) for t in tokens]


def test_greedy_outputs_with_the_draft_are_sglangs_plain_outputs(smollm2_target, prompts, plain, drafted):
    """SGLang's CPU path computes in bf16 (its intel_amx kernels have no fp32), and a verify pass of 4 tokens runs
    other GEMM shapes than a decode step of 1, so the two may order a near-tie differently: the outputs are equal
    token for token up to such a tie. Each divergence is checked to be one: both tokens within BF16_TIE of the fp32
    target's top logit (measured: three tokens within 0.03 of each other at one of them)."""
    answers, _, _ = plain
    (counts, answer, totals, _), record = drafted
    assert len(counts.outputs) == PROMPTS
    equal, ties = 0, []
    for prompt, served, alone in zip(prompts, counts.outputs, (a.tokens for a in answers)):
        at = _first_divergence(served, alone)
        if at is None:
            assert len(served) == len(alone)
            equal += 1
            continue
        below = _below_top(smollm2_target, prompt, alone[:at], (served[at], alone[at]))
        ties.append((at, below))
        assert max(below) < BF16_TIE, (at, below, served[at], alone[at])
    print(f"{equal} of {PROMPTS} outputs equal token for token; the others part at bf16 near-ties "
          f"(position, each token's fp32 logit below the top): {ties}")
    assert counts.source == "per-request" and counts.drafts > 0
    assert totals is not None and totals.draft_seconds is None and totals.rounds >= counts.drafts
    assert set(answer.stats.verified_lengths) <= {1, CHAIN + 1}
    assert "--speculative-num-steps 3" in " ".join(record["command"])


def test_served_tau_is_the_replay_of_the_same_draft(smollm2_target, prompts, drafted):
    from eaglewire.core.presets import resolve_draft
    from eaglewire.doctor.served_tau.served_check import chain_length, replay_served
    from eaglewire.model.checkpoint import load_draft

    (counts, _, _, _), _ = drafted
    draft, contract, _ = load_draft(resolve_draft("reference"), target=smollm2_target)
    replayed = replay_served(smollm2_target, draft, list(contract.aux_boundaries), prompts,
                             counts.outputs, chain_length(counts, CHAIN))
    print(f"served τ {counts.tau:.3f} ({counts.drafts} steps), replayed τ {replayed.tau:.3f} "
          f"({replayed.drafts} rounds), text agreement {replayed.text_agreement:.3f}")
    # SGLang computes in bf16 (its intel_amx kernels), eaglewire's replay in fp32: the text is SGLang's own, so
    # only the draft's near-ties can differ; the vLLM check's tolerance holds
    assert counts.tau == pytest.approx(replayed.tau, abs=0.05), (counts.tau, replayed.tau, counts.accepted_per_pos,
                                                                 replayed.accepted_per_pos)


def test_the_doctor_passes_the_export_as_trained(drafted):
    (_, _, _, (code, report, seconds)), _ = drafted
    checks = _checks(report)
    print(f"doctor against SGLang, export as written: exit {code} in {seconds:.0f} s")
    assert code == 0, json.dumps(report["checks"], indent=1)
    assert "read from the running server" in checks["launch flags"]["summary"]
    assert checks["served acceptance"]["verdict"] == "ok"


def test_the_doctor_names_the_seeds_ids_from_the_running_server(seeds_ids, drafted):
    """The served config's ids are the trained boundaries: SGLang's llama.py captures [3, 16, 28]. On SmolLM2 this
    draft barely notices a one-layer shift (its layout sweep puts [1, 15, 27] within 0.003 of [2, 15, 27]), so τ
    alone would not tell; the doctor reads the ids from what the running server loads and FAILS with the fix."""
    bad, counts, (code, report, seconds) = seeds_ids
    (good, _, _, _), _ = drafted
    print(f"seeds' ids {SEEDS_IDS}: served τ {counts.tau:.3f} against {good.tau:.3f} as exported; doctor exit {code} "
          f"in {seconds:.0f} s")
    assert code == 1
    wiring = _checks(report)["engine wiring"]
    assert wiring["verdict"] == "fail" and "[2, 15, 27]" in wiring["summary"]
    assert '"eagle_aux_hidden_state_layer_ids": [1, 14, 26]' in wiring["fix"]  # the line that feeds the draft
    assert str(bad) in _checks(report)["engine config"]["summary"]  # read from what the server loads


def test_the_doctor_says_the_flags_capped_the_draft(capped):
    """SGLang overrides --speculative-num-draft-tokens 16 to steps + 1 = 2 and reports 2, so the server's own
    settings cannot show what the user asked for: given the launch line, the doctor says the flags capped the draft
    and what to launch; from the server alone it names the chain served, and ranks it against longer ones (a
    WARN only where a longer chain is predicted faster by more than the margin: not for this draft, whose chains
    of 1 and 2 tie under the stated GPU cost model)."""
    info, (code, report, seconds), (line_code, line_report, _) = capped
    print(f"server info: num_steps {info['speculative_num_steps']}, num_draft_tokens "
          f"{info['speculative_num_draft_tokens']}; doctor exit {code} in {seconds:.0f} s")
    assert info["speculative_num_steps"] == 1 and info["speculative_num_draft_tokens"] == 2  # SGLang's override
    checks = _checks(report)
    assert "--speculative-num-steps 1 --speculative-eagle-topk 1" in checks["launch flags"]["summary"]
    speed = checks["speed"]
    assert "--speculative-num-steps 1 " in json.dumps(speed["evidence"])  # the launch's chain, ranked
    if "launch shape" in checks:
        assert checks["launch shape"]["verdict"] == "warn"
    flags = _checks(line_report)["serving flags"]
    print(flags["summary"], flags["evidence"], "| fix:", flags["fix"])
    text = json.dumps(flags)
    assert flags["verdict"] == "warn" and "capped the draft" in text and "drafts 1 token a round, not the 15" in text
    assert "--speculative-num-steps 15" in text
