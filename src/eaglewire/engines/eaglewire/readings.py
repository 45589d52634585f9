"""eaglewire's own engine (``eaglewire generate`` / ``serve`` / ``bench``): it reads the contract the
draft records, so its ids are the boundaries themselves, and it runs and is measured here. Its
launch flags are SGLang's names (``--speculative-num-steps`` ...), with an inconsistent chain an
error instead of a silent adjustment.
"""

from __future__ import annotations

from eaglewire.engines.serving.launch_flags import Flags, as_int, chain_shape, parse_flags

NAME = "eaglewire"


def to_ids(boundaries: list[int], num_layers: int, arch: str | None) -> list[int]:
    return list(boundaries)


def to_boundaries(ids: list[int], num_layers: int, arch: str | None) -> list[int]:
    return list(ids)


def lint_flags(flags: str, declared: list[int], num_layers: int, arch: str | None) -> Flags:
    """eaglewire's flags that it would refuse."""
    return chain_shape(parse_flags(flags), Flags(), verdict="fail", silently="eaglewire refuses it")


def lint_dflash_flags(flags: str, declared: list[int], num_layers: int, arch: str | None, block_size: int) -> Flags:
    """eaglewire's flags for a DFlash draft of ``block_size``: a block drafts at most ``block_size - 1``
    tokens, and more steps are refused (decode/dflash_drafter.py check_block_steps)."""
    out = Flags()
    out.num_steps = as_int(parse_flags(flags).get("--speculative-num-steps"))
    if out.num_steps is not None and out.num_steps > block_size - 1:
        out.problems.append(("fail", f"--speculative-num-steps {out.num_steps}: a DFlash block of {block_size} "
                             f"drafts at most {block_size - 1} tokens, and eaglewire refuses more",
                             f"--speculative-num-steps {block_size - 1}"))
    return out


# ---------------------------------------------------------------- served acceptance (doctor --engine-url)
# ``eaglewire serve`` exports vLLM 0.33.0's speculative counters under its own prefix
# (``eaglewire_spec_decode_num_drafts_total`` ..., serve/metrics.py Metrics) and, with
# --per-request-spec-decode-metrics, vLLM's per-request ``metrics.speculative_decoding``: the reader of that
# shape (engines/serving/spec_decode_metrics.py) reads it.

METRICS_PREFIX = "eaglewire_"
TRAFFIC = ("eaglewire_generated_tokens_total", "eaglewire_requests_running")  # serve/metrics.py Metrics.families


def measure_served(url: str, prompts: list[list[int]], *, max_new_tokens: int, timeout: float = 900.0):
    """Greedy completions of ``prompts`` from ``eaglewire serve`` at ``url`` and what it accepted."""
    from eaglewire.engines.serving.spec_decode_metrics import measure_served as measure

    return measure(url, prompts, max_new_tokens=max_new_tokens, timeout=timeout, prefix=METRICS_PREFIX, engine=NAME,
                   traffic_names=TRAFFIC)


def served_version(url: str) -> str | None:
    """The version ``eaglewire serve`` reports at ``/version`` (vLLM's route)."""
    from eaglewire.engines.serving.served_counts import version_at

    return version_at(url, who="eaglewire server")


def judged(served: str | None) -> tuple[str, str]:
    from eaglewire import __version__

    return f"eaglewire {__version__}", (f"judged with this eaglewire's own reading ({__version__}; the server says {served or 'nothing'})"
            + ("" if served in (None, __version__) else ": another eaglewire version serves, whose reading may differ"))


ACCEPTANCE_RULE = "eaglewire's sampling_verify (a chain's token accepted with p_T(x))"  # decode/verify.py
