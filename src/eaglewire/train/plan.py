"""How much data the quickstart regenerates and how long it trains, sized to this machine's measured speed.

The quickstart's wall clock is fixed by its defaults: the data stage of ``BASE_CONVERSATIONS`` conversations plus
``--minutes`` of training, both at this machine's measured speeds. A machine that trains faster (bf16 where the CPU
computes it natively: AMX, or avx512_bf16; a GPU) would finish its steps early and repeat the same few conversations
for many epochs; instead it spends the time it saves on data: the plan picks the number of conversations C such that
regenerating and capturing them and training ``EPOCHS`` passes over their tokens fill the same wall clock W:

    C * data_seconds + EPOCHS * C * TOKENS_PER_CONVERSATION / speed = W,  W = BASE_CONVERSATIONS * data_seconds + minutes

(speed: training tokens per second, measured by ``train.probe``; data_seconds: regeneration and capture per
conversation, measured by ``data.probe`` in the precision and on the device the data stage runs in; without it the
fixed ``REGEN_SECONDS`` of one CPU, which was 5x off on another). The defaults' 48 conversations trained for
~18 epochs on the machine they were sized on and overfit (training acc@0 0.83 against 0.22 held out,
BENCHMARKS.md "The quickstart, default settings"); ``EPOCHS`` keeps fewer passes over more data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["DataPlan", "plan_data", "BASE_CONVERSATIONS"]

BASE_CONVERSATIONS = 48  # the slice the quickstart's wall clock was sized on
MAX_CONVERSATIONS = 400  # a 2-core machine regenerates ~6 per minute: beyond this the plan would be regeneration
EPOCHS = 6  # passes over the regenerated tokens the plan aims for (18 overfit, see above)
# Measured on AMD EPYC (AVX-512 + avx512_bf16), 2 threads, defaults (max length 512, 128 new tokens): 48
# conversations regenerated in 488 s into 14,982 tokens (BENCHMARKS.md, "The quickstart, default settings").
REGEN_SECONDS = 10.2
TOKENS_PER_CONVERSATION = 312
REPLY_TOKENS_PER_CONVERSATION = 176.5  # the same run's 8,472 reply tokens over 48 conversations


@dataclass(frozen=True)
class DataPlan:
    conversations: int  # regenerated and captured for training
    train_minutes: float  # the training stage's budget
    epochs: int  # passes over the data the steps are planned for
    tokens_per_second: float  # training speed measured here
    precision: str  # the training precision it was measured in
    sized: bool  # False: --num-conversations was given, the plan only times the steps
    data_seconds: float | None = None  # regeneration + capture per conversation measured here (None: REGEN_SECONDS)

    def describe(self) -> str:
        head = (f"{self.conversations} conversations, training {self.train_minutes:.1f} min for {self.epochs} epochs"
                f" at the {self.tokens_per_second:,.0f} tokens/s measured here ({self.precision})")
        if not self.sized:
            return head + "; --num-conversations given"
        data = (f", regenerating and capturing a conversation in {self.data_seconds:.1f} s" if self.data_seconds
                else "")
        return (head + data + f"; sized so regeneration and training fill the wall clock of {BASE_CONVERSATIONS} "
                "conversations plus --minutes")

    def record(self) -> dict:
        return asdict(self)


def plan_data(*, tokens_per_second: float, minutes: float, precision: str, conversations: int | None = None,
              data_seconds: float | None = None) -> DataPlan:
    """The plan for a training budget of ``minutes`` at ``tokens_per_second`` and a data stage of ``data_seconds``
    per conversation (None: ``REGEN_SECONDS``); ``conversations`` given: train on those, planning the steps to the
    measured speed within ``minutes``."""
    if tokens_per_second <= 0 or minutes <= 0:
        raise ValueError(f"a plan needs a positive speed and budget, got {tokens_per_second} tokens/s, {minutes} min")
    if conversations is not None:
        epochs = max(1, int(minutes * 60 * tokens_per_second // (conversations * TOKENS_PER_CONVERSATION)))
        return DataPlan(conversations, minutes, epochs, tokens_per_second, precision, sized=False,
                        data_seconds=data_seconds)
    per_data = data_seconds or REGEN_SECONDS  # seconds per conversation
    wall = BASE_CONVERSATIONS * per_data + minutes * 60  # seconds
    per_conversation = per_data + EPOCHS * TOKENS_PER_CONVERSATION / tokens_per_second  # seconds
    count = min(MAX_CONVERSATIONS, max(BASE_CONVERSATIONS, int(wall // per_conversation)))
    train_seconds = max(wall - count * per_data, 60.0)
    epochs = max(1, int(train_seconds * tokens_per_second // (count * TOKENS_PER_CONVERSATION)))
    return DataPlan(count, round(train_seconds / 60, 2), epochs, tokens_per_second, precision, sized=True,
                    data_seconds=data_seconds)
