"""The settings of a training run (``eaglewire train``'s flags and ``--config run.yaml`` are generated from
them): what a run is (its identity, which ``--resume`` holds fixed) and what may change between an
interrupted run and its resume."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from eaglewire.core.contract import FAMILIES
from eaglewire.core.device import device_field
from eaglewire.core.precision import DTYPE_CHOICES
from eaglewire.core.presets import DEFAULT_TARGET
from eaglewire.train.curves import REPORT_TO

EAGLE3_DRAFT_VOCAB = 8192  # --draft-vocab-size of an EAGLE-3 draft when not given


@dataclass(kw_only=True)
class TrainConfig:
    out: str = field(metadata={"help": "draft output directory (checkpoint, metrics, plots)"})
    target: str = field(default=DEFAULT_TARGET, metadata={"help": "preset name, HF model directory or .gguf file"})
    data: str | None = field(default=None, metadata={"help": "shard directory written by `eaglewire prepare` (offline mode)"})
    online_data: str | None = field(default=None, metadata={"help": "conversations (preset or file) captured live (online mode)"})
    num_conversations: int | None = field(default=None, metadata={"help": "online mode: use at most this many conversations"})
    offset: int = field(default=0, metadata={"help": "online mode: skip this many conversations first"})
    max_length: int = field(default=1024, metadata={"help": "online mode: truncate sequences to this many tokens"})
    aux_boundaries: list[int] | None = field(default=None, metadata={"help": "online mode: boundaries to capture (default [2, L//2, L-3])"})
    ttt_steps: int = field(default=7, metadata={"help": "training-time-test unroll steps"})
    loss_decay: float = field(default=0.8, metadata={"help": "weight of step j is loss_decay**j"})
    draft_vocab_size: int | None = field(default=None, metadata={"help": "draft vocabulary size (most frequent assistant tokens); default 8192 for EAGLE-3, the target's whole vocabulary for DFlash (which predicts with the target's head: a smaller vocabulary computes only those rows)"})
    init_draft: str | None = field(default=None, metadata={"help": "start from this draft's weights and vocabulary (same contract; new optimizer and schedule); an SGLang, SpecForge, speculators or EAGLE directory is converted"})
    epochs: int = field(default=1, metadata={"help": "passes over the training split"})
    max_steps: int | None = field(default=None, metadata={"help": "stop after this many optimizer steps"})
    minutes: float | None = field(default=None, metadata={"help": "stop (resumably) after this much wall time"})
    stop_at_step: int | None = field(default=None, metadata={"help": "stop (resumably) at this step; the schedule still runs to --max-steps"})
    lr: float = field(default=1e-4, metadata={"help": "peak learning rate"})
    warmup_steps: int = field(default=20, metadata={"help": "linear warmup steps before cosine decay"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    grad_clip: float = field(default=0.5, metadata={"help": "gradient norm clip"})
    batch_tokens: int = field(default=4096, metadata={"help": "padded tokens per micro-batch (per rank)"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step and rank: a step trains on world x grad_accum micro-batches"})
    val_sequences: int = field(default=32, metadata={"help": "held-out sequences for validation"})
    val_data: str | None = field(default=None, metadata={"help": "shard directory to validate on (its first --val-sequences) instead of a split of --data, which is then trained on whole: e.g. the target's own replies held out while training on the dataset's"})
    early_stop: int = field(default=0, metadata={"help": "stop once the held-out loss has not reached a new low for this many evaluations in a row (0: never)"})
    eval_interval: int = field(default=100, metadata={"help": "validate every N steps"})
    save_interval: int = field(default=100, metadata={"help": "checkpoint every N steps"})
    log_interval: int = field(default=10, metadata={"help": "write metrics every N steps"})
    seed: int = field(default=0, metadata={"help": "random seed (data order, init)"})
    device: str = device_field()
    resume: bool = field(default=False, metadata={"help": "continue the run in --out exactly where it stopped", "record": False})
    allow_target_mismatch: list[str] | None = field(default=None, metadata={"help": "target fingerprint fields allowed to differ from the data's, e.g. weights_sha256 for a requantized target"})
    head_only: bool = field(default=False, metadata={"help": "offline mode: read only the target's embedding, final norm and lm_head (never its layers)"})
    allow_incomplete_data: bool = field(default=False, metadata={"help": "train on --data whose `prepare` did not finish (refused otherwise; a warning says how much it covers)"})
    skip_label_check: bool = field(default=False, metadata={"help": "train without the label check at start (the target's head on the stored last state against the stored next tokens); only for a target that is not a language model of this text, e.g. a random test target"})
    family: str = field(default="eagle3", metadata={"help": "draft family: eagle3 (one token per draft pass, TTT) or dflash (a block per pass)", "choices": list(FAMILIES)})
    block_size: int = field(default=8, metadata={"help": "dflash: positions per block (the anchor + block_size - 1 drafted tokens)"})
    draft_layers: int = field(default=2, metadata={"help": "dflash: decoder layers of the draft (an EAGLE-3 draft has one)"})
    anchors_per_sequence: int = field(default=32, metadata={"help": "dflash: blocks sampled per sequence and step (anchors on supervised tokens)"})
    block_loss_gamma: float | None = field(default=None, metadata={"help": "dflash: drafted position j weighs exp(-(j-1)/gamma) in the loss (default by block size: 7 for 16, 5 for 10, 4 for 8)"})
    mask_token_id: int | None = field(default=None, metadata={"help": "dflash: the token filling the drafted positions (default: a padded embedding row, the tokenizer's mask token or an unused special token)"})
    dtype: str = field(default="auto", metadata={"choices": DTYPE_CHOICES, "help": "the draft's compute precision: auto (bf16 where the CPU computes bf16 natively, i.e. avx512_bf16 or AMX with oneDNN, and on CUDA; fp32 elsewhere), fp32, bf16 (autocast; fp32 weights, loss and softmax)"})
    report_to: str = field(default="none", metadata={"choices": REPORT_TO, "help": "where the training curves also go: none (metrics.jsonl and training.png only) or tensorboard (event files in --out/runs)"})
    prefetch: int = field(default=2, metadata={"help": "offline mode: training batches read ahead on a background thread while the step computes (0: read in the step)"})
    sync_free: str = field(default="auto", metadata={"choices": ("auto", "on", "off"), "help": "eagle3: steps that never wait for the device (counts and the non-finite loss check stay on it until a log row, evaluation or checkpoint is due; the draft head and loss run at every position, masked); auto: on CUDA"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the draft's norms and MLP (dynamic shapes; falls back to eager with a warning if compiling fails)"})

    def __post_init__(self) -> None:
        if (self.data is None) == (self.online_data is None):
            raise ValueError("give exactly one of --data (shards from `eaglewire prepare`) or "
                             "--online-data (conversations captured live)")
        if self.head_only and self.data is None:
            raise ValueError("--head-only trains on stored states (--data); online capture runs the whole target")
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        if self.draft_vocab_size is None and self.family == "eagle3":
            self.draft_vocab_size = EAGLE3_DRAFT_VOCAB
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        for name in ("epochs", "batch_tokens", "grad_accum", "eval_interval", "save_interval", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.loss_decay <= 1:
            raise ValueError(f"loss_decay must be in (0, 1], got {self.loss_decay}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        for name in ("draft_layers", "anchors_per_sequence"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the anchor and one drafted token), got {self.block_size}")
        if self.block_loss_gamma is not None and self.block_loss_gamma <= 0:
            raise ValueError(f"block_loss_gamma must be > 0, got {self.block_loss_gamma}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 (batches read ahead), got {self.prefetch}")
        if self.sync_free not in ("auto", "on", "off"):
            raise ValueError(f"sync_free must be auto, on or off, got {self.sync_free!r}")
        if self.sync_free == "on" and self.family != "eagle3":
            raise ValueError(f"--sync-free on is EAGLE-3's step; family {self.family!r} takes auto or off")

    # Fields that may change between an interrupted run and its resume.
    RESUMABLE_CHANGES = frozenset({"minutes", "stop_at_step", "early_stop", "eval_interval", "save_interval", "log_interval", "resume", "device",
                                   "head_only", "allow_incomplete_data", "skip_label_check", "dtype", "report_to",
                                   "prefetch", "sync_free", "compile"})

    def identity(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in self.RESUMABLE_CHANGES}
