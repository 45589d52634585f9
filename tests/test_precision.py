"""--dtype auto|fp32|bf16: what each resolves to on which machine, and why it says so."""

import logging

import pytest
import torch

import eaglewire.core.machine as machine
from eaglewire.core.precision import log_precision, precision_of, resolve_precision


@pytest.mark.parametrize("native, want", [(True, "bf16"), (False, "fp32")])
def test_auto_on_a_cpu_follows_native_bf16_and_says_why(native, want, monkeypatch):
    monkeypatch.setattr(machine, "native_bf16", lambda flags=None: native)
    p = resolve_precision("auto", "cpu")
    assert (p.name, p.requested, p.dtype) == (want, "auto", {"bf16": torch.bfloat16, "fp32": torch.float32}[want])
    assert ("natively" in p.reason) == native and ("no native bf16" in p.reason) == (not native)
    assert p.record() == {"dtype": want, "requested": "auto", "device": "cpu", "reason": p.reason}


def test_auto_on_cuda_is_bf16_as_before():
    assert resolve_precision("auto", "cuda", native=False).name == "bf16"
    assert resolve_precision("fp32", "cuda").name == "fp32"


def test_explicit_choices_win_and_slow_bf16_is_a_warning(caplog):
    assert resolve_precision("fp32", "cpu", native=True).name == "fp32"
    slow = resolve_precision("bf16", "cpu", native=False)
    assert slow.name == "bf16" and "slower than fp32" in slow.reason
    with caplog.at_level(logging.INFO, logger="eaglewire.core.precision"):
        log_precision(slow, "train")
        log_precision(resolve_precision("bf16", "cpu", native=True), "train")
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]
    assert "train computes in bf16 (--dtype bf16)" in caplog.records[1].getMessage()


def test_an_unknown_dtype_names_the_choices():
    with pytest.raises(ValueError, match=r"--dtype 'int8' is not one of auto, fp32, bf16"):
        resolve_precision("int8", "cpu")


@pytest.mark.parametrize("name, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_autocast_runs_matmuls_in_the_chosen_dtype(name, dtype):
    linear = torch.nn.Linear(4, 4)
    with resolve_precision(name, "cpu", native=True).autocast():
        out = linear(torch.randn(2, 4))
    assert out.dtype == dtype and linear.weight.dtype == torch.float32  # fp32 master weights


def test_a_loaded_models_dtype_is_recorded_as_such():
    p = precision_of(torch.bfloat16, "cpu", requested="auto", reason="handed in")
    assert (p.name, p.reason) == ("bf16", "handed in")
