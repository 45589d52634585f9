"""eaglewire's own engine, one package like the others: its readings (ids = boundaries, launch-flag lint, what
``eaglewire serve`` says it accepted) in ``readings.py``, assembled here into its ``SPEC``."""

from eaglewire.engines.eaglewire.readings import (ACCEPTANCE_RULE, METRICS_PREFIX, NAME, TRAFFIC, judged,
                                                  lint_dflash_flags, lint_flags, measure_served, served_version,
                                                  to_boundaries, to_ids)
from eaglewire.engines.interface import EngineSpec, IdReading, Linter, Sampling

SPEC = EngineSpec(
    name=NAME, measure=measure_served, in_process=True, served_version=served_version, judged=judged,
    sampling=Sampling(acceptance_rule=ACCEPTANCE_RULE),
    eagle3=IdReading(to_ids=to_ids, to_boundaries=to_boundaries),
    linter=Linter(lint_flags=lint_flags, lint_dflash_flags=lint_dflash_flags),
)

__all__ = ["ACCEPTANCE_RULE", "METRICS_PREFIX", "NAME", "SPEC", "TRAFFIC", "judged", "lint_dflash_flags", "lint_flags",
           "measure_served", "served_version", "to_boundaries", "to_ids"]
