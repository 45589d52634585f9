"""conversations -> (regenerated replies) -> captured states -> shards.

Shapes: B batch, T tokens, H target hidden size, k number of aux boundaries.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from tqdm.auto import tqdm

from eaglewire.model.boundary_capture import capture_packed
from eaglewire.core.contract import (HiddenStateContract, default_aux_boundaries, describe_template_kwargs,
                                     validate_aux_boundaries)
from eaglewire.data.conversations import (
    PLAIN_TEMPLATE, TokenizedConversation, load_conversations, tokenize_conversation)
from eaglewire.data.batching import pack_by_tokens
from eaglewire.data.regenerate import Pace
from eaglewire.data.remote_regenerate import RemoteConfig, meta_path, read_meta
from eaglewire.data.shards import ShardWriter, read_sources, shard_work, source_differences
from eaglewire.data.capture_writer import StagedBatch, WriterThread, to_host
from eaglewire.data.state_codec import STATE_DTYPES, Storage, encode_states, label_positions
from eaglewire.data.sources import pad_right
from eaglewire.decode.sampling import MAX_NEW_TOKENS
from eaglewire.core.distributed import dist_rank_world
from eaglewire.core.locks import LOCK_NAME, directory_lock
from eaglewire.core.presets import DATA_PRESETS, DEFAULT_TARGET, data_path
from eaglewire.core.precision import Precision, log_precision, precision_of, resolve_precision
from eaglewire.core.device import device_field, resolve_device
from eaglewire.model.target import Target, load_target, load_tokenizer

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class PrepareConfig:
    out: str = field(metadata={"help": "output directory for shards and manifest.json"})
    target: str = field(default=DEFAULT_TARGET, metadata={"help": "preset name, HF model directory or .gguf file"})
    data: str = field(default="sharegpt", metadata={"help": "data preset (sharegpt), a ShareGPT .json / messages .jsonl file, a parquet file or a directory of them, or a datasets directory"})
    num_conversations: int | None = field(default=None, metadata={"help": "use at most this many conversations"})
    offset: int = field(default=0, metadata={"help": "skip this many conversations first (e.g. to hold some out)"})
    aux_boundaries: list[int] | None = field(default=None, metadata={"help": "boundaries to capture, e.g. 2,15,27 (default [2, L//2, L-3])"})
    max_length: int = field(default=1024, metadata={"help": "truncate sequences to this many tokens"})
    regenerate: bool = field(default=False, metadata={"help": "replace assistant replies with the target's own first"})
    max_new_tokens: int = field(default=MAX_NEW_TOKENS, metadata={"help": "reply length limit when regenerating"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature when regenerating (0 = greedy)"})
    max_turns: int | None = field(default=None, metadata={"help": "regenerate at most this many replies per conversation; the conversation ends there (default: all)"})
    regenerate_batch_size: int = field(default=8, metadata={"help": "conversations regenerated together (rows of one batched generation)"})
    storage_dtype: str = field(default="bf16", metadata={"help": "dtype of hidden states on disk: bf16 or fp16"})
    batch_tokens: int | None = field(default=None, metadata={"help": "tokens per capture batch, padding included (default: 8192 on the CPU, 16384 on CUDA; at least --max-length)"})
    shard_tokens: int = field(default=65536, metadata={"help": "tokens per shard file"})
    device: str = device_field()
    dtype: str = field(default="auto", metadata={"help": "target compute dtype of the capture: auto (bf16 on CUDA and where the CPU computes bf16 natively, i.e. avx512_bf16 or AMX with oneDNN; fp32 elsewhere), fp32, bf16; recorded in the manifest (status.capture_precision)"})
    chat_template: str | None = field(default=None, metadata={"help": "a Jinja chat template file to render conversations with (instead of the tokenizer's; for base models)"})
    template: str = field(default="chat", metadata={"help": "chat: the tokenizer's chat template (or --chat-template); plain: a minimal 'User: / Assistant:' template for base models (README)"})
    overwrite: bool = field(default=False, metadata={"help": "delete the shards, manifests and regenerated replies already in --out and start over", "record": False})
    remote: RemoteConfig = field(default_factory=RemoteConfig)  # --regenerate through servers: its flags
    state_dtype: str | None = field(default=None, metadata={"choices": STATE_DTYPES, "help": "aux states on disk: fp8 (e4m3 with a scale per token and boundary, half the bytes), or bf16/fp16 (default: --storage-dtype)"})
    capture: str = field(default="here", metadata={"help": "where the states are computed: here (the target in this process) or an engine that captures them (vllm or sglang: launched here, or the one at --capture-url); the first sequences are captured both ways and compared per boundary"})
    capture_url: str | None = field(default=None, metadata={"help": "a running engine with state extraction on (the launch line `prepare --capture ENGINE` logs): vLLM's storage path must be readable here; SGLang takes AUX_URL,LABEL_URL (two servers)"})
    capture_tensor_parallel: int = field(default=1, metadata={"help": "--tensor-parallel-size of the vLLM launched to capture"})
    capture_python: str | None = field(default=None, metadata={"help": "the python of the engine to launch (default: the one `eaglewire engines install ENGINE` made)"})
    capture_threads: int = field(default=2, metadata={"help": "threads of the engine launched to capture"})
    head_only: bool = field(default=False, metadata={"help": "a target too large for this process: read only its tokenizer, embedding, last decoder layer, final norm and lm_head; the states come from --capture ENGINE, checked with the last layer on the engine's boundary L-1 instead of a whole in-process capture"})
    skip_label_check: bool = field(default=False, metadata={"help": "no label check after the capture (the target's head on the stored last state against the stored next tokens); only for a target that is not a language model of this text, e.g. a random test target captured --head-only", "record": False})
    labels: str = field(default="hidden", metadata={"help": "the target's signal on disk: hidden (the last hidden state) or topk:K (the target's K most likely tokens and log-probabilities at reply positions, e.g. topk:32)"})

    def __post_init__(self) -> None:
        if self.num_conversations is not None and self.num_conversations < 1:
            raise ValueError(f"num_conversations must be >= 1, got {self.num_conversations}")
        if self.offset < 0:
            raise ValueError(f"offset must be >= 0, got {self.offset}")
        if self.max_length < 8:
            raise ValueError(f"max_length must be >= 8 tokens, got {self.max_length}")
        if self.batch_tokens is not None and self.batch_tokens < self.max_length:
            raise ValueError(f"batch_tokens ({self.batch_tokens}) must be >= max_length ({self.max_length}) "
                             "so that one sequence fits a batch")
        if self.storage_dtype not in ("bf16", "fp16"):
            raise ValueError(f"storage_dtype must be bf16 or fp16, got {self.storage_dtype!r}")
        if self.template not in TEMPLATES:
            raise ValueError(f"template must be one of {', '.join(TEMPLATES)}, got {self.template!r}")
        if self.template == "plain" and self.chat_template is not None:
            raise ValueError("give --chat-template FILE or --template plain, not both")
        if self.remote.remote and not self.regenerate:
            raise ValueError("--server / --llamacpp-gguf give the server to regenerate replies through: add "
                             "--regenerate (or drop them to keep the data's own replies)")
        Storage(dtype=self.storage_dtype, state_dtype=self.state_dtype, labels=self.labels)  # names the bad flag
        if self.capture != HERE:
            from eaglewire.engines import Ability, get

            try:
                get(self.capture, Ability.CAPTURE, param="--capture")
            except ValueError as e:
                raise ValueError(f"{e}, or {HERE} (the target in this process)") from None
        elif self.capture_url is not None:
            raise ValueError("--capture-url names a running engine's server: add --capture ENGINE (e.g. vllm)")
        if self.head_only and self.capture == HERE:
            raise ValueError("--head-only loads only the target's last layer, so the states must come from an "
                             "engine: add --capture ENGINE (e.g. vllm, with --capture-url for one you run)")

    @property
    def regenerates_through_capture(self) -> bool:
        """--regenerate --capture ENGINE without --server: the capturing engine's server writes the replies too."""
        return self.regenerate and not self.remote.remote and self.capture != HERE


TEMPLATES = ("chat", "plain")
HERE = "here"  # --capture: the target in this process
_HASH_WHOLE = 64 << 20  # files up to this size are hashed whole; larger ones by size + ends
_PREPARED = re.compile(r"(manifest(\.rank\d+-of-\d+)?\.json|shard-(r\d+-)?\d+\.safetensors|"
                       r"regenerated\.rank\d+\.jsonl(\.meta\.json)?)(\.tmp)?")


@dataclass
class PrepareSummary:
    out: str
    conversations_loaded: int
    sequences: int
    tokens: int
    loss_tokens: int
    bytes_on_disk: int
    truncated_sequences: int
    dropped_no_loss_tokens: int
    resumed_sequences: int
    seconds: float
    skipped: dict[str, int]
    regenerate_seconds: float = 0.0  # of seconds: regenerating the replies
    capture_seconds: float = 0.0  # of seconds: capturing the states and writing the shards

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_on_disk / max(self.tokens, 1)

    def rows(self) -> list[tuple[str, str]]:
        return [
            ("conversations loaded", f"{self.conversations_loaded:,}"),
            ("sequences written", f"{self.sequences:,}" + (f" ({self.resumed_sequences:,} from an earlier run)" if self.resumed_sequences else "")),
            ("tokens", f"{self.tokens:,}"),
            ("assistant (loss) tokens", f"{self.loss_tokens:,}"),
            ("truncated to max length", f"{self.truncated_sequences:,}"),
            ("dropped: no reply left", f"{self.dropped_no_loss_tokens:,}"),
            ("bytes on disk", f"{self.bytes_on_disk / 2**20:,.1f} MiB"),
            ("bytes per token", f"{self.bytes_per_token:,.0f}"),
            ("wall time", f"{self.seconds:,.1f} s" + (f" (regenerating {self.regenerate_seconds:,.1f} s)"
                                                      if self.regenerate_seconds else "")),
        ]


def resolve_data(data: str) -> Path:
    return data_path(data) if data in DATA_PRESETS else Path(data)


def file_identity(path: Path) -> dict[str, object]:
    """What identifies an input file's content: size and sha256 (whole, or of the first and
    last MiB for files over 64 MiB). A directory (a datasets one) is identified by each of its files."""
    if path.is_dir():
        return {"files": {f.relative_to(path).as_posix(): file_identity(f)
                          for f in sorted(path.rglob("*")) if f.is_file()}}
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _HASH_WHOLE:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        else:
            digest.update(f.read(1 << 20))
            f.seek(size - (1 << 20))
            digest.update(f.read())
    return {"bytes": size, "sha256": digest.hexdigest(),
            "hashed": "whole file" if size <= _HASH_WHOLE else "first and last MiB"}


def resolve_template(config: PrepareConfig, tokenizer) -> tuple[str, str]:
    """(name, text) of the chat template to render with; refuses, before any model is loaded,
    a tokenizer without one unless --chat-template or --template plain says what to use."""
    if config.chat_template is not None:
        path = Path(config.chat_template)
        if not path.is_file():
            raise FileNotFoundError(f"--chat-template {path}: no such file; pass a Jinja chat template file")
        return str(path), path.read_text()
    if config.template == "plain":
        return "plain", PLAIN_TEMPLATE
    text = getattr(tokenizer, "chat_template", None)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"--target {config.target}: its tokenizer has no chat template (a base model?), "
                         "so conversations cannot be rendered. Pass --chat-template FILE (a Jinja chat "
                         "template), or --template plain to render them as 'User: ... / Assistant: ...' "
                         "text (README, \"Pipeline\")")
    return "tokenizer", text


def source_record(config: PrepareConfig, path: Path, template: tuple[str, str]) -> dict[str, object]:
    """The input's identity and every setting that shapes the stored sequences; a resume must match."""
    name, text = template
    record: dict[str, object] = {
        "data": config.data, "path": str(path), "file": file_identity(path), "offset": config.offset,
        "num_conversations": config.num_conversations, "max_length": config.max_length,
        "aux_boundaries": config.aux_boundaries, "regenerated": config.regenerate,
        "template": {"name": name, "sha256": hashlib.sha256(text.encode()).hexdigest(),
                     **({"text": text} if name != "tokenizer" else {})}}
    if config.regenerate:
        record["regenerate"] = {"max_new_tokens": config.max_new_tokens, "temperature": config.temperature,
                                **({"batch_size": config.regenerate_batch_size} if config.temperature else {})}
        if config.max_turns is not None:
            record["max_turns"] = config.max_turns
        if config.remote.remote or config.regenerates_through_capture:  # not URLs: a resume may reach it elsewhere
            which = ({"model": config.remote.server_model} if config.remote.remote else {"capture": config.capture})
            record["regenerate"]["server"] = {**which, "reasoning": config.remote.reasoning,
                                              "chat_template_kwargs": config.remote.template_kwargs()}
    if (meta := read_meta(path)) is not None:  # replies of `eaglewire regenerate`: how they were made
        record["regenerated_by"] = meta.get("settings")
    if kwargs := data_template_kwargs(config, path):  # absent for the template's defaults: older resumes match
        record["chat_template_kwargs"] = kwargs
    return record


def data_template_kwargs(config: PrepareConfig, path: Path) -> dict[str, Any]:
    """The chat-template switches the shards are rendered with, recorded in their contract: those of
    ``--enable-thinking`` / ``--no-enable-thinking``, else those a conversations file's replies were
    regenerated with (its ``OUT.meta.json``), else ``{}`` (the template's own defaults). Without
    ``--regenerate``, a flag other than the file's is refused: the replies were written under the file's."""
    flag = config.remote.template_kwargs()
    meta = read_meta(path)
    made = None if meta is None else ((meta.get("settings") or {}).get("chat_template_kwargs") or {})
    if flag is not None and made is not None and flag != made and not config.regenerate:
        raise ValueError(f"--data {config.data}: its replies were regenerated with {describe_template_kwargs(made)} "
                         f"({meta_path(path)}), but --enable-thinking asks for {describe_template_kwargs(flag)}; "
                         "drop the flag to render the shards as the replies were made, or add --regenerate to "
                         "write new replies with it")
    return dict(flag if flag is not None else made if made is not None else {})


def check_resumable(out: Path, source: dict[str, object]) -> None:
    """Refuse to resume into ``out`` when what it holds came from other input or settings."""
    for name, recorded in read_sources(out):
        if recorded != source:
            raise ValueError(f"--out {out} already holds data prepared from other input or with other "
                             f"settings ({name}: {source_differences(recorded, source)}). Resuming would "
                             "mix them. Use another --out, or add --overwrite to delete that data and "
                             "start over")


def _check_boundaries_early(config: PrepareConfig, target: Target | None) -> None:
    """Check --aux-boundaries against the layer count from config.json, before loading weights."""
    if config.aux_boundaries is None:
        return
    if target is not None:
        num_layers = target.num_layers
    elif (Path(config.target) / "config.json").is_file():
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(config.target)
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        num_layers = getattr(cfg, "num_hidden_layers", None)
        if not isinstance(num_layers, int):
            return  # the contract check after loading says it
    else:
        return
    validate_aux_boundaries(list(config.aux_boundaries), num_layers)


def remove_prepared(out: Path) -> None:
    """--overwrite: delete what `prepare` writes (manifests, shards, regenerated replies), nothing else."""
    if not out.is_dir():
        return
    for path in sorted(out.iterdir()):
        if _PREPARED.fullmatch(path.name) and path.is_file():
            log.info("--overwrite: removing %s", path)
            path.unlink()


# Tokens per capture batch, and conversations sorted by length together (fewer padded tokens, fuller batches),
# where a device computes: on the CPU as they always were (the same batches give the same shards, bit for bit).
BATCH_TOKENS = {"cpu": 8192, "cuda": 16384}
SORT_WINDOW = {"cpu": 64, "cuda": 512}


def capture_plan(batch_tokens: int | None, max_length: int, device: torch.device) -> tuple[int, int]:
    """(tokens per capture batch, conversations sorted together) on ``device``; ``batch_tokens`` None: the
    device's default (at least ``max_length``, so that one sequence fits)."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    return batch_tokens or max(BATCH_TOKENS[kind], max_length), SORT_WINDOW[kind]


def batches_by_tokens(seqs: list[TokenizedConversation], batch_tokens: int) -> Iterator[list[TokenizedConversation]]:
    """Group sequences (sorted by length) so that rows x longest row <= batch_tokens."""
    ordered = sorted(seqs, key=lambda s: len(s.input_ids))
    yield from pack_by_tokens(ordered, [len(s.input_ids) for s in ordered], batch_tokens)


def capture_batch(target: Target, contract: HiddenStateContract, batch: list[TokenizedConversation],
                  storage: Storage) -> StagedBatch:
    """Capture a right-padded batch and stage it for the shard writer: its real tokens' states in ``storage``'s
    dtypes with the writer's checks, computed on the target's device, on their way to the host (nothing waits
    for the device here)."""
    lengths = [len(s.input_ids) for s in batch]
    ids = pad_right([torch.tensor(s.input_ids) for s in batch], max(lengths))  # [B, T]
    out = capture_packed(target, ids, lengths, contract)  # aux [N, kH], last [N, H]
    rows = label_rows = None
    if storage.labels_mode == "topk":  # each sequence's labelled positions, as indices into N
        starts = [0, *accumulate(lengths)]
        positions = [label_positions(torch.tensor(s.loss_mask)).nonzero()[:, 0] + a for s, a in zip(batch, starts)]
        label_rows = [len(r) for r in positions]
        rows = [r.to(target.device, non_blocking=True) for r in positions]
    stored, checks = encode_states(storage, out.aux_hidden, out.last_hidden, contract.num_aux, label_rows=rows,
                                   head=target.head)
    host, ready = to_host({**stored, "checks": checks})
    return StagedBatch(ids=[s.id for s in batch], lengths=lengths,
                       input_ids=torch.tensor([t for s in batch for t in s.input_ids], dtype=torch.int32),
                       loss_mask=torch.tensor([m for s in batch for m in s.loss_mask], dtype=torch.uint8),
                       stored={k: v for k, v in host.items() if k != "checks"}, checks=host["checks"],
                       label_rows=label_rows, ready=ready)


@contextmanager
def _engine_capture(config: PrepareConfig, target: Target, contract: HiddenStateContract, out: Path):
    """The engine that captures (``--capture``), launched here or at ``--capture-url``; None: in process."""
    if config.capture == HERE:
        yield None
        return
    from eaglewire.engines import Ability, get
    from eaglewire.engines.interface import CaptureSettings

    capturer = get(config.capture, Ability.CAPTURE, param="--capture").capturer
    context = config.max_length + 16
    if config.regenerates_through_capture:  # a prompt and its reply fit too
        context = max(context, _regenerate_config(config).context)
    settings = CaptureSettings(dtype=str(target.dtype).removeprefix("torch."), threads=config.capture_threads,
                               tensor_parallel=config.capture_tensor_parallel, install=config.capture_python,
                               max_model_len=max(context, 256))
    boundaries, L = list(contract.aux_boundaries), target.num_layers
    if config.head_only:  # the head-only check runs the last layer on the engine's boundary L-1
        boundaries = sorted(set(boundaries) | {L - 1})
    arch = target.fingerprint.architecture
    log.info("a target that needs many GPUs: serve it yourself with\n  %s\nand pass --capture-url",
             capturer.launch_line(config.target, boundaries, L, arch, settings, out.resolve() / "engine-states"))
    with capturer.capture(config.target, boundaries, L, arch, settings, work_dir=out,
                          url=config.capture_url) as engine:
        yield engine


def engine_batch(engine, target: Target, contract: HiddenStateContract, batch: list[TokenizedConversation],
                 checked: dict[int, float], *, cross_check: bool = True):
    """``capture_batch`` through ``engine``: (seq, aux [T, kH], last [T, H]) per sequence; the first
    CHECKED_SEQUENCES of the run compared with the states here per boundary (``checked``: boundary -> the largest
    relative error so far, with the count under key -1). ``cross_check=False``: a head-only target cannot compute
    the states here; its last layer is checked on the engine's boundary L-1 instead (and the label check after the
    run)."""
    from eaglewire.data.engine_capture import (CHECKED_SEQUENCES, POST_NORM, PRE_NORM, require_last_layer,
                                               require_same_states, split_states)
    from eaglewire.model.target_head import unnorm_weight

    require = require_same_states if cross_check else require_last_layer
    last_state = getattr(engine, "last_state", PRE_NORM)
    unnorm = unnorm_weight(target) if last_state == POST_NORM else None
    for s in batch:
        states = engine.states(list(s.input_ids))  # [T, n, H]
        if checked.get(-1, 0) < CHECKED_SEQUENCES:
            for c in require(states, engine.boundaries, target, list(s.input_ids), engine.version,
                             sequence=f"conversation {s.id}", last_state=last_state):
                checked[c.boundary] = max(checked.get(c.boundary, 0.0), c.own)
            checked[-1] = checked.get(-1, 0) + 1
        aux, last = split_states(states, engine.boundaries, list(contract.aux_boundaries), target.num_layers,
                                 unnorm)
        yield s, aux, last


def _check_record(checked: dict[int, float], target: Target, *, head_only: bool = False,
                  last_state: str | None = None) -> dict[str, Any]:
    """The manifest's ``status.capture_check``: sequences compared, the tolerance, each boundary's largest error;
    with ``head_only`` only boundary L (and 0) were compared, and it says how; ``last_state`` post-norm: the engine
    answered the label state after the final norm, and it says how it was compared and stored."""
    from eaglewire.data.engine_capture import POST_NORM, TOLERANCE

    record = {"sequences": int(checked.get(-1, 0)),
              "tolerance": TOLERANCE.get(target.dtype, TOLERANCE[torch.bfloat16]),
              "max_relative_error": {str(b): float(f"{e:.3g}") for b, e in sorted(checked.items()) if b >= 0}}
    if head_only:
        record["instead"] = HEAD_ONLY_CHECK
    if last_state == POST_NORM:
        record["label_state"] = POST_NORM_LABEL
    return record


HEAD_ONLY_CHECK = ("--head-only: the target's layers but the last are not here to compute the states; the engine's "
                   "label state is checked as the last layer applied to its boundary L-1 (and boundary 0 as the "
                   "embedding output), and the label check (the target's head on the stored boundary-L states gives "
                   "its own next tokens) runs after")


POST_NORM_LABEL = ("the engine answers the label state (boundary L) after the final norm: it was compared with ours "
                   "normed, and is stored as y / norm(1), whose norm is y (as import-data --last-state post-norm "
                   "stores it), so the target's head on it gives the engine's logits")


def _add_each(writer: ShardWriter, captured: list[tuple[TokenizedConversation, torch.Tensor, torch.Tensor]]) -> None:
    """Sequences with their states (aux [T, kH], last [T, H]) into ``writer``, one at a time."""
    for seq, aux, last in captured:
        writer.add(seq.id, torch.tensor(seq.input_ids, dtype=torch.int32),
                   torch.tensor(seq.loss_mask, dtype=torch.uint8), aux, last)


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def prepare(config: PrepareConfig, *, target: Target | None = None, progress: bool = True,
            pace: Pace | None = None) -> PrepareSummary:
    """Run the data pipeline into ``config.out``; resumes when the directory holds earlier work.
    One run writes a directory at a time (a second gets DirectoryLocked; under torchrun, one per rank).
    ``pace``: ``regenerate``'s, for a regeneration in this process (the quickstart's check of its plan)."""
    rank, world = dist_rank_world()
    name = LOCK_NAME if world == 1 else f".eaglewire.rank{rank}-of-{world}.lock"
    with directory_lock(config.out, what=f"--out {config.out}", name=name):
        try:
            return _prepare(config, target, progress, pace)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # what is written is whole (atomic writes) and kept
            e.add_note(f"the shards written so far in {config.out} are kept: run the same command again to "
                       "resume from them")
            raise


def _prepare(config: PrepareConfig, target: Target | None, progress: bool, pace: Pace | None) -> PrepareSummary:
    start = time.perf_counter()
    out = Path(config.out)
    _check_boundaries_early(config, target)
    source_path = resolve_data(config.data)
    if not source_path.exists():
        raise FileNotFoundError(f"--data {config.data}: {source_path} does not exist; pass a preset "
                                f"({', '.join(DATA_PRESETS)}), a ShareGPT .json, a messages .jsonl, a parquet file "
                                "or a directory of them, or a datasets directory (save_to_disk)")
    # Everything that can be refused is checked before the target is loaded.
    template = resolve_template(config, target.tokenizer if target is not None else load_tokenizer(config.target))
    source = source_record(config, source_path, template)
    if config.overwrite:
        remove_prepared(out)
    else:
        check_resumable(out, source)
    conversations, report = load_conversations(source_path, limit=config.num_conversations, offset=config.offset)
    log.info("%s", report.summary())
    out.mkdir(parents=True, exist_ok=True)
    precision = _capture_precision(config, target)
    target = target or _load(config, precision.dtype)
    if getattr(target.tokenizer, "chat_template", None) != template[1]:
        target.tokenizer.chat_template = template[1]  # the fingerprint records what is used
        target._fingerprint = None
    boundaries = config.aux_boundaries or default_aux_boundaries(target.num_layers)
    kwargs = data_template_kwargs(config, source_path)
    contract = HiddenStateContract(aux_boundaries=tuple(boundaries), target=target.fingerprint,
                                   chat_template_kwargs=kwargs)
    rank, world = dist_rank_world()
    conversations = shard_work(conversations, rank, world)

    writer = ShardWriter(out, contract, source=source, dtype=config.storage_dtype,
                         shard_tokens=config.shard_tokens, rank=rank, world_size=world,
                         state_dtype=config.state_dtype, labels=config.labels, labels_head=target.head)
    # Written before any work: an interrupted run leaves data that says it is incomplete.
    writer.set_status(complete=False, conversations=len(conversations), load_report=report.to_dict(),
                      capture_precision=precision.record())
    regenerated = 0.0  # seconds
    if config.regenerate and not config.regenerates_through_capture:  # before an engine that would wait idle
        conversations, regenerated = _regenerate(target, conversations, out, writer, config, rank, progress,
                                                 pace=pace)
    resumed = len(writer.done_ids)
    truncated = 0
    dropped: list[str] = []
    with writer, _engine_capture(config, target, contract, out) as engine:
        if config.regenerates_through_capture:
            conversations, regenerated = _regenerate(target, conversations, out, writer, config, rank, progress,
                                                     engine=engine)
        capture_start = time.perf_counter()
        bar = tqdm(total=len(conversations), desc="capture", unit="conv", disable=not progress)
        writer.set_status(capture=engine.version if engine is not None else HERE)
        checked: dict[int, float] = {}  # boundary -> the largest relative error of the sequences captured both ways
        batch_tokens, window = capture_plan(config.batch_tokens, config.max_length, target.device)
        with WriterThread() as background:  # the writer's shards are written there, behind the capture
            for chunk in _chunks(conversations, window):
                todo = []
                for conv in chunk:
                    if conv.id in writer.done_ids:
                        bar.update(1)
                        continue
                    seq = tokenize_conversation(conv, target.tokenizer, max_length=config.max_length,
                                                template_kwargs=kwargs or None)
                    truncated += seq.num_tokens_before_truncation > len(seq.input_ids)
                    if sum(seq.loss_mask) == 0:
                        dropped.append(conv.id)
                        bar.update(1)
                        continue
                    todo.append(seq)
                for batch in batches_by_tokens(todo, batch_tokens):
                    if engine is None:
                        background.submit(partial(capture_batch(target, contract, batch, writer.storage).commit,
                                                  writer))
                    else:
                        captured = list(engine_batch(engine, target, contract, batch, checked,
                                                     cross_check=not config.head_only))
                        background.submit(partial(_add_each, writer, captured))
                    bar.update(len(batch))
        totals = writer.close()
        captured = time.perf_counter() - capture_start
        if engine is not None:
            writer.set_status(capture_check=_check_record(checked, target, head_only=config.head_only,
                                                          last_state=getattr(engine, "last_state", None)))
        writer.set_status(complete=True, conversations=len(conversations), dropped_no_reply=dropped,
                          truncated_to_max_length_this_run=truncated)
    bar.close()
    if world == 1 and totals["sequences"]:  # under torchrun the other ranks' parts may not be written yet
        if config.skip_label_check:
            log.warning("label check skipped (--skip-label-check): train and doctor --stored run it again")
        else:
            _check_labels(out, target)
    return PrepareSummary(
        out=str(out), conversations_loaded=len(conversations), sequences=totals["sequences"],
        tokens=totals["tokens"], loss_tokens=totals["loss_tokens"], bytes_on_disk=totals["bytes"],
        truncated_sequences=truncated, dropped_no_loss_tokens=len(dropped), resumed_sequences=resumed,
        seconds=time.perf_counter() - start, skipped=dict(report.skipped), regenerate_seconds=regenerated,
        capture_seconds=captured)


def _load(config: PrepareConfig, dtype: torch.dtype) -> Target:
    """The target as this run needs it: whole, or (``--head-only``) its tokenizer, embedding, final norm and
    lm_head with the layers left unread."""
    if not config.head_only:
        return load_target(config.target, device=config.device, dtype=dtype)
    from eaglewire.model.target_head import load_target_head

    log.info("%s", HEAD_ONLY_CHECK)
    return load_target_head(config.target, device=resolve_device(config.device), dtype=dtype, layers=(-1,))


def _capture_precision(config: PrepareConfig, target: Target | None) -> Precision:
    """What the target computes the states in (``--dtype``; a target handed in keeps its own), logged."""
    if target is not None:
        precision = precision_of(target.dtype, target.device, requested=config.dtype,
                                 reason="the target handed to prepare keeps the dtype it was loaded in")
    else:
        precision = resolve_precision(config.dtype, resolve_device(config.device))
    log_precision(precision, "prepare's capture")
    return precision


def _check_labels(out: Path, target: Target) -> None:
    """The label check on a sample of what was written (``label_check.py``); refuses a capture whose
    stored last state does not give the target's own predictions."""
    from eaglewire.data.label_check import require_labels
    from eaglewire.data.shards import ShardDataset

    require_labels(ShardDataset(out, verify=False), target, where=f"prepare --out {out}")


def _regenerate_config(config: PrepareConfig):
    from eaglewire.data.regenerate import RegenerateConfig

    return RegenerateConfig(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                            max_turns=config.max_turns, batch_size=config.regenerate_batch_size)


def _regenerate(target, conversations, out: Path, writer: ShardWriter, config: PrepareConfig, rank: int,
                progress: bool, *, engine=None, pace: Pace | None = None):
    """The conversations with their replies regenerated, and the seconds it took: through ``--server``, through the
    capturing ``engine``'s server (its states of each generation discarded: the shards' are captured from the rendered
    conversation), or by the target here at ``pace``; the manifest's status says how they were made."""
    from eaglewire.data.regenerate import regenerate
    from eaglewire.data.remote_regenerate import regenerate_remote, server_urls

    path = out / f"regenerated.rank{rank}.jsonl"
    regen_config = _regenerate_config(config)
    if config.remote.remote:
        with server_urls(config.remote, ctx_per_slot=regen_config.context) as urls:
            regen = regenerate_remote(conversations, path, tokenizer=target.tokenizer, config=regen_config,
                                      remote=config.remote, urls=urls, target=config.target, progress=progress)
    elif engine is not None:
        log.info("regenerating through %s at %s, the server that captures", engine.version, engine.url)
        regen = regenerate_remote(conversations, path, tokenizer=target.tokenizer, config=regen_config,
                                  remote=config.remote, urls=[engine.url], target=config.target, progress=progress,
                                  on_answer=engine.discard)
    else:
        regen = regenerate(target, conversations, path, progress=progress, config=regen_config,
                           template_kwargs=config.remote.template_kwargs(), pace=pace)
    log.info("%s", regen.summary())
    if (meta := read_meta(path)) is not None:
        writer.set_status(regenerated_by=meta.get("settings"))  # the server's model id, sampling, reasoning
    done, _ = load_conversations(path)
    return done, regen.seconds
