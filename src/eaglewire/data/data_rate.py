"""How long the data stage takes here per conversation, measured on what it will run: ``prepare`` itself on the
first conversations of its slice, every assistant turn regenerated after its growing history through the batched
path, then captured, in the precision and on the device the stage runs in (seconds, in a scratch directory).

The quickstart sizes its slice with it (``train/plan.py``). A fixed cost per conversation measured on one CPU was
wrong by 5x on another; a synthetic probe (one 136-token prompt and one reply per conversation) read 0.8 s where the
stage took 5.3 s (issue 64): ShareGPT's conversations have ~3 assistant turns, each after a longer history, with
long-tailed prompt lengths and the batches' padding groups.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from eaglewire.data.prepare import PrepareConfig, prepare
from eaglewire.model.target import Target

PROBE_CONVERSATIONS = 8  # one batch of the stage's regeneration (PrepareConfig.regenerate_batch_size)


def data_seconds_per_conversation(target: Target, config: PrepareConfig, *, sample: int = PROBE_CONVERSATIONS,
                                  progress: bool = False, keep: Path | None = None) -> dict[str, float]:
    """Seconds the data stage ``config`` spends here on one of its conversations: its first ``sample`` prepared as
    it prepares them (``config.out`` unused). Returns the parts (``regenerate``, ``capture``) and their sum
    (``seconds``), the stage's fixed costs (reading the data, the label check) left out; and what a conversation
    yields, ``tokens`` and ``reply_tokens`` (the labelled ones), which size training. ``keep``: the sample's
    shards are written there and kept (the training probe trains on them)."""
    count = min(sample, config.num_conversations or sample)
    with tempfile.TemporaryDirectory(prefix="eaglewire-probe-") as scratch:
        s = prepare(replace(config, out=str(keep or scratch), num_conversations=count), target=target,
                    progress=progress)
    regenerate, capture = s.regenerate_seconds / count, s.capture_seconds / count
    return {"regenerate": regenerate, "capture": capture, "seconds": regenerate + capture,
            "tokens": s.tokens / count, "reply_tokens": s.loss_tokens / count}
