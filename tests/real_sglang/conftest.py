"""The real SGLang (sglang 0.5.23 with its CPU kernels built here, in eaglewire's own venv or the interpreter in
EAGLEWIRE_SGLANG_PYTHON): every test here is marked ``sglang`` and skips, saying how to install it, where there is
none."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def sglang_installation():
    from eaglewire.engines.sglang.installation import INSTALL_HINT, SglangError, find
    from eaglewire.engines.sglang.kernels import cpu_refusal

    if cpu_refusal() and not os.environ.get("EAGLEWIRE_SGLANG_PYTHON"):
        pytest.skip(cpu_refusal())
    try:
        found = find(os.environ.get("EAGLEWIRE_SGLANG_PYTHON") or None)
    except SglangError as e:
        pytest.skip(str(e))
    if found is None:
        pytest.skip(f"SGLang is not installed: {INSTALL_HINT} (or set EAGLEWIRE_SGLANG_PYTHON to a python whose "
                    "sgl_kernel has the CPU ops)")
    return found
