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

A probe is a sample: the data stage checks the plan against its own pace after its first ``REPLAN_AFTER``
conversations and after every batch from then on (``paced``), and when it is off by more than ``REPLAN_OFF_BY``
re-plans within the same wall clock (``replan``): fewer conversations and less training where the stage is slower,
more training where it is faster (a synthetic probe read 0.8 s a conversation where the stage took 5.3 s: 34 minutes
of regeneration where the plan budgeted about 5, issue 64).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

__all__ = ["DataPlan", "plan_data", "paced", "replan", "BASE_CONVERSATIONS"]

BASE_CONVERSATIONS = 48  # the slice the quickstart's wall clock was sized on
MAX_CONVERSATIONS = 400  # a 2-core machine regenerates ~6 per minute: beyond this the plan would be regeneration
EPOCHS = 6  # passes over the regenerated tokens the plan aims for (18 overfit, see above)
# Measured on AMD EPYC (AVX-512 + avx512_bf16), 2 threads, defaults (max length 512, 128 new tokens): 48
# conversations regenerated in 488 s into 14,982 tokens (BENCHMARKS.md, "The quickstart, default settings").
REGEN_SECONDS = 10.2
TOKENS_PER_CONVERSATION = 312
REPLAN_AFTER = 16  # conversations the data stage regenerates before its own pace is trusted (two batches of 8)
REPLAN_OFF_BY = 0.25  # the stage's pace may be off the plan's by this fraction before it re-plans


@dataclass(frozen=True)
class DataPlan:
    conversations: int  # regenerated and captured for training
    train_minutes: float  # the training stage's budget
    epochs: int  # passes over the data the steps are planned for
    tokens_per_second: float  # training speed measured here
    precision: str  # the training precision it was measured in
    sized: bool  # False: --num-conversations was given, the plan only times the steps
    data_seconds: float | None = None  # regeneration + capture per conversation measured here (None: REGEN_SECONDS)
    capture_seconds: float = 0.0  # the capture's part of data_seconds (the stage's pace checks the rest)
    probed_seconds: float | None = None  # re-planned: the data_seconds the probe measured (None: not re-planned)
    tokens_per_conversation: float = TOKENS_PER_CONVERSATION  # what a conversation yields, measured by the probe
    passes: int = EPOCHS  # passes over the data the plan aims for (the recipe's)
    most: int = MAX_CONVERSATIONS  # conversations at most (the recipe's)

    @property
    def seconds_per_conversation(self) -> float:
        """The data stage's planned seconds per conversation."""
        return self.data_seconds or REGEN_SECONDS

    @property
    def budget_seconds(self) -> float:
        """The wall clock the plan gives regeneration, capture and training."""
        return self.conversations * self.seconds_per_conversation + self.train_minutes * 60

    def describe(self) -> str:
        head = (f"{self.conversations} conversations, training {self.train_minutes:.1f} min for {self.epochs} epochs"
                f" at the {self.tokens_per_second:,.0f} tokens/s measured here ({self.precision})")
        if not self.sized:
            return head + "; --num-conversations given"
        data = (f", preparing a conversation (its replies and states) in {self.data_seconds:.1f} s" if self.data_seconds
                else "")
        why = (f"re-planned at the data stage's own pace (the probe said {self.probed_seconds:.1f} s) to fill"
               if self.probed_seconds is not None else
               f"sized so the data stage and training fill the wall clock of {BASE_CONVERSATIONS} conversations plus "
               "--minutes,")
        return f"{head}{data}; {why} {self.budget_seconds / 60:.1f} min"

    def record(self) -> dict:
        return asdict(self)


def plan_data(*, tokens_per_second: float, minutes: float, precision: str, conversations: int | None = None,
              data_seconds: float | None = None, capture_seconds: float = 0.0,
              tokens_per_conversation: float | None = None, passes: int = EPOCHS,
              most: int = MAX_CONVERSATIONS) -> DataPlan:
    """The plan for a training budget of ``minutes`` at ``tokens_per_second`` and a data stage of ``data_seconds``
    per conversation (None: ``REGEN_SECONDS``; ``capture_seconds`` of it capturing) yielding
    ``tokens_per_conversation`` (None: ``TOKENS_PER_CONVERSATION``), aiming for ``passes`` over at most ``most``
    conversations; ``conversations`` given: train on those, planning the steps to the measured speed within
    ``minutes``."""
    if passes < 1 or most < BASE_CONVERSATIONS:
        raise ValueError(f"a plan needs passes >= 1 and most >= {BASE_CONVERSATIONS}, got {passes}, {most}")
    if tokens_per_second <= 0 or minutes <= 0:
        raise ValueError(f"a plan needs a positive speed and budget, got {tokens_per_second} tokens/s, {minutes} min")
    tokens = round(tokens_per_conversation or TOKENS_PER_CONVERSATION, 1)
    if conversations is not None:
        epochs = max(1, int(minutes * 60 * tokens_per_second // (conversations * tokens)))
        return DataPlan(conversations, minutes, epochs, tokens_per_second, precision, sized=False,
                        data_seconds=data_seconds, capture_seconds=capture_seconds, tokens_per_conversation=tokens,
                        passes=passes, most=most)
    per_data = data_seconds or REGEN_SECONDS  # seconds per conversation
    wall = BASE_CONVERSATIONS * per_data + minutes * 60  # seconds
    return DataPlan(**_fill(wall, per_data, tokens_per_second, tokens, passes, least=BASE_CONVERSATIONS, most=most),
                    tokens_per_second=tokens_per_second, precision=precision, sized=True, data_seconds=data_seconds,
                    capture_seconds=capture_seconds, tokens_per_conversation=tokens, passes=passes, most=most)


def paced(plan: DataPlan, *, regenerated: int, seconds: float, done: int) -> DataPlan:
    """The plan in force once the data stage has regenerated ``regenerated`` conversations in ``seconds`` and is
    ``done`` conversations into its slice: ``plan`` while the stage keeps within ``REPLAN_OFF_BY`` of its pace (or
    has regenerated fewer than ``REPLAN_AFTER``, or --num-conversations fixed the slice), else ``replan`` at the
    stage's own pace, its capture still at the probed cost."""
    if not plan.sized or regenerated < REPLAN_AFTER:
        return plan
    measured = seconds / regenerated + plan.capture_seconds  # seconds per conversation
    if abs(measured / plan.seconds_per_conversation - 1) <= REPLAN_OFF_BY:
        return plan
    return replan(plan, data_seconds=measured, done=done)


def replan(plan: DataPlan, *, data_seconds: float, done: int) -> DataPlan:
    """``plan`` for a data stage of ``data_seconds`` per conversation, ``done`` conversations into its slice: the same
    wall clock, no more conversations than planned (only those are loaded) and no fewer than ``done``, training for
    the rest of it."""
    sized = _fill(plan.budget_seconds, data_seconds, plan.tokens_per_second, plan.tokens_per_conversation,
                  plan.passes, least=max(BASE_CONVERSATIONS, done), most=plan.conversations)
    return replace(plan, **sized, data_seconds=round(data_seconds, 2),
                   probed_seconds=plan.seconds_per_conversation if plan.probed_seconds is None else plan.probed_seconds)


def _fill(wall: float, data_seconds: float, speed: float, tokens: float, passes: int, *, least: int,
          most: int) -> dict:
    """The conversations (``least`` to ``most``), training minutes and epochs that fill ``wall`` seconds with a data
    stage of ``data_seconds`` per conversation of ``tokens`` and ``passes`` over them at ``speed`` tokens/s."""
    per_conversation = data_seconds + passes * tokens / speed  # seconds
    count = min(most, max(least, int(wall // per_conversation)))
    train_seconds = max(wall - count * data_seconds, 60.0)
    epochs = max(1, int(train_seconds * speed // (count * tokens)))
    return {"conversations": count, "train_minutes": round(train_seconds / 60, 2), "epochs": epochs}
