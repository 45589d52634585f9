"""The real vLLM under load (one server for the module: the reference draft's export, a chain of 3): the clients of
``bench --concurrency`` get every greedy answer as vLLM gives it alone, and the load ``tune --concurrency`` times is
held at its batch (ignore_eos honoured) with vLLM's own round counter read per sequence."""

from __future__ import annotations

import pytest

from eaglewire.engines import export_draft
from eaglewire.engines.interface import RunSettings, Shape
from load_checks import (check_answers_under_load_as_alone, check_doctor_sees_other_clients,
                         check_timed_load_counts_every_sequences_rounds)

pytestmark = [pytest.mark.vllm, pytest.mark.real]

NEW_TOKENS = 32


@pytest.fixture(scope="module", autouse=True)
def installed(vllm_installation):
    """Skip before any other fixture loads the target, where vLLM is absent."""
    return vllm_installation


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    from eaglewire.core.prompts import load_prompts
    from eaglewire.decode.text import encode_prompt

    return [encode_prompt(smollm2_tokenizer, p.text, chat=p.chat) for p in load_prompts("mt-bench", limit=3)]


@pytest.fixture(scope="module")
def loaded_server(tmp_path_factory, vllm_installation):
    from eaglewire.engines.vllm.server import RUNTIME

    work = tmp_path_factory.mktemp("vllm-load")
    settings = RunSettings(install=str(vllm_installation.python), slots=4)
    files = RUNTIME.files("reference", "smollm2-135m", work, settings, export=export_draft)
    with RUNTIME.serve(files, Shape(3), settings, log_path=work / "loaded.log") as server:
        yield server


def test_vllm_under_load_answers_each_request_as_it_does_alone(loaded_server, prompts):
    """Exact in fp32: vLLM's speculative output equals its plain output in test_vllm_served.py, rows of other batch
    sizes alike."""
    check_answers_under_load_as_alone(loaded_server, prompts, NEW_TOKENS)


def test_tunes_load_on_vllm_holds_its_batch_and_counts_every_sequences_rounds(loaded_server, prompts):
    check_timed_load_counts_every_sequences_rounds(loaded_server, prompts)


def test_the_doctors_reading_of_vllm_sees_other_clients(loaded_server, prompts):
    from eaglewire.engines import vllm

    check_doctor_sees_other_clients(loaded_server, vllm.measure_served, prompts, "vllm:num_requests_running")
