"""The doctor's settings: every flag of ``eaglewire doctor``, with its default and help, checked once."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TypeVar

from eaglewire import engines as engine_registry
from eaglewire.engines import Ability
from eaglewire.core.device import device_field
from eaglewire.core.presets import DEFAULT_TARGET

Part = TypeVar("Part")


@dataclass(kw_only=True)
class DoctorConfig:
    draft: str = field(metadata={"help": "draft directory: native, or SGLang/SpecForge/speculators/EAGLE (detected, converted, its reading stated)"})
    target: str = field(default=DEFAULT_TARGET, metadata={"help": "preset name, HF model directory or .gguf file"})
    device: str = device_field()
    data: str | None = field(default=None, metadata={"help": "shard directory (enables the capture drift check)"})
    conversations: str | None = field(default=None, metadata={"help": "conversations (preset or file) to capture now"})
    num_sequences: int = field(default=64, metadata={"help": "held-out sequences to measure on"})
    max_length: int = field(default=160, metadata={"help": "tokens per sequence"})
    offset: int = field(default=0, metadata={"help": "conversations: skip this many first (when the draft "
                                                      "records no held-out ids)"})
    include_training: bool = field(default=False, metadata={"help": "measure on any sequences, not only those "
                                                                     "the draft held out from training"})
    steps: int = field(default=3, metadata={"help": "draft steps measured in isolation (acc@0, cond acc@1..)"})
    engine: str = field(default="eaglewire", metadata={"help": "serving engine: " + ", ".join(engine_registry.names(Ability.LINT))})
    engine_config: str | None = field(default=None, metadata={"help": "the draft config.json the engine will load (llamacpp: the draft .gguf)"})
    engine_flags: str | None = field(default=None, metadata={"help": "the engine's launch flags, quoted"})
    target_arch: str | None = field(default=None, metadata={"help": "the target's architecture as the engine loads "
                                                                    "it (default: the one the draft records)"})
    engine_url: str | None = field(default=None, metadata={"help": "base URL of the running --engine server (sglang, vllm, llamacpp, eaglewire): its served τ and per-position acceptance on the held-out prompts, against the replay on its own text"})
    engine_prompts: int = field(default=4, metadata={"help": "prompts for the measured acceptance (0 skips it)"})
    engine_tokens: int = field(default=32, metadata={"help": "new tokens per prompt for the measured acceptance"})
    probe_tokens: int = field(default=1024, metadata={"help": "--engine-url: new tokens the doctor may ask of the "
                              "server on probe prompts chosen to separate the wirings its first answers cannot tell "
                              "apart (0: no probes)"})
    min_tokens: int = field(default=1000, metadata={"help": "judged reply tokens below which the verdict is "
                                                             "inconclusive (too little evidence to pass)"})
    tune: bool = field(default=True, metadata={"help": "rank chain shapes by predicted tokens/s for --engine and say "
                                                        "what to serve (eaglewire: measured here; sglang, vllm, "
                                                        "speculators: a stated GPU cost model; llamacpp: run "
                                                        "`eaglewire tune --engine llamacpp`)"})
    concurrency: list[int] | None = field(default=None, metadata={
        "help": "batch sizes (e.g. 1,2,4,8): the speed check says up to how many concurrent requests the draft "
                "pays (eaglewire: its engine measured here at each in the shape that pays for one request; other "
                "engines: the `eaglewire tune` command that measures them; default: one request)"})
    json: str | None = field(default=None, metadata={"help": "also write the report as JSON here"})
    cache: bool = field(default=True, metadata={"help": "reuse the checks an earlier run computed from the same "
                        "draft, target, held-out data and settings (in $EAGLEWIRE_CACHE/doctor): a check of a "
                        "running server then measures only the server; --no-cache recomputes them"})
    stored: bool = field(default=False, metadata={"help": "judge from the stored states in --data alone, the target never "
                                                          "run: --target needs only its config, tokenizer, embedding, "
                                                          "final norm and lm_head"})
    compare_data: str | None = field(default=None, metadata={"help": "--stored: a second capture of the same "
                                                                     "sequences (another engine or precision): drift"})
    labels: str = field(default="head", metadata={"help": "--stored: the target's signal from its head on the stored "
                                                          "last state (head) or the stored next tokens (tokens)"})
    traffic: str | None = field(default=None, metadata={"help": "prompts users send (JSONL of OpenAI chat or completion "
                                                                "requests, request logs, or prompt lines): the draft's "
                                                                "acceptance on them beside the held-out data, by slice"})
    traffic_prompts: int = field(default=32, metadata={"help": "--traffic: prompts read from the file"})
    traffic_tokens: int = field(default=48, metadata={"help": "--traffic: reply tokens the target writes per prompt"})
    skip_label_check: bool = field(default=False, metadata={"help": "--stored: no label check (the target's head on "
                                                                     "the stored last state against the stored next "
                                                                     "tokens); only for a target that is not a language "
                                                                     "model of this text, e.g. a random test target"})
    allow_target_mismatch: list[str] | None = field(default=None, metadata={
        "help": "target fingerprint fields allowed to differ from the draft's and the data's (a warning, then "
                "measured), e.g. weights_sha256 for a requantized target or one recorded as unknown"})
    temperature: float | None = field(default=None, metadata={
        "help": "the temperature users sample at: the draft's expected acceptance there beside the greedy "
                "figures (default: read from the --traffic requests, llama-server's --temp in --engine-flags, or "
                "the target's generation_config.json where vLLM and SGLang apply it; else unknown)"})
    chat_template_kwargs: str | None = field(default=None, metadata={
        "help": "the chat template kwargs serving renders with by default, as JSON (e.g. '{\"enable_thinking\": "
                "false}'; default: read from --engine-flags, else unknown), compared with those the draft's data "
                "was rendered with"})

    def __post_init__(self) -> None:
        if self.data and self.conversations:
            raise ValueError("give --data (shards) or --conversations, not both")
        if not self.stored and (self.compare_data or self.labels != "head"):
            raise ValueError("--compare-data and --labels read stored states: add --stored")
        engines = engine_registry.names(Ability.LINT)
        if self.engine not in engines:
            raise ValueError(f"--engine {self.engine!r} is not one of {', '.join(engines)}")
        if self.engine_url and not engine_registry.get(self.engine).can(Ability.MEASURE):
            raise ValueError(f"--engine-url reads a running server's own counters; --engine {self.engine!r} has none "
                             f"eaglewire reads: use --engine {' or '.join(engine_registry.names(Ability.MEASURE))}")
        if self.traffic and self.stored:
            raise ValueError("--traffic needs the target to write replies; it cannot run with --stored")
        if self.temperature is not None and not 0 <= self.temperature < float("inf"):
            raise ValueError(f"--temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.temperature is not None and self.stored:
            raise ValueError("--temperature measures acceptance on the target's own distributions; it cannot "
                             "run with --stored")
        for name in ("num_sequences", "max_length", "steps", "min_tokens", "traffic_prompts", "traffic_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.concurrency is not None:
            self._check_concurrency()
        if self.probe_tokens < 0:
            raise ValueError(f"--probe-tokens must be >= 0 (0: no probes), got {self.probe_tokens}")

    def settings(self, part: type[Part]) -> Part:
        """The few settings one part of the doctor reads: ``part``, a frozen dataclass whose fields are named as
        these flags (``ServedSettings``, ``LoadSettings``, ...), filled from them. Checked and defaulted here only."""
        return part(**{f.name: getattr(self, f.name) for f in fields(part)})

    def _check_concurrency(self) -> None:
        """``--concurrency``: ascending batch sizes >= 1, and the speed check it extends must run."""
        levels = self.concurrency
        if not levels or any(b < 1 for b in levels) or levels != sorted(set(levels)):
            raise ValueError(f"--concurrency takes ascending batch sizes >= 1 (e.g. 1,2,4,8), got {levels}")
        if not self.tune:
            raise ValueError("--concurrency extends the speed check, which --no-tune turns off: drop one of them")
        if self.stored:
            raise ValueError("--concurrency measures eaglewire's engine decoding with the target; it cannot run "
                             "with --stored")
