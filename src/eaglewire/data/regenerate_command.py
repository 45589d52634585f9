"""The ``regenerate`` command, in this process or through servers: its settings
(``RegenerateCommandConfig``: the conversations, the target, ``RegenerateConfig``'s sampling,
``RemoteConfig``'s servers) and ``run_regenerate``, which hands the conversations to
``remote_regenerate.regenerate_remote`` when a server is given, else to ``regenerate.regenerate``
with the target loaded here. Either way ``<out>.meta.json`` records the settings.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eaglewire.core.device import DEVICE_HELP, device_field
from eaglewire.core.fileio import atomic_write_json
from eaglewire.core.locks import file_lock
from eaglewire.core.presets import DATA_PRESETS, DEFAULT_TARGET, data_path
from eaglewire.data.conversations import load_conversations
from eaglewire.data.regenerate import RegenerateConfig, RegenerateReport, regenerate
from eaglewire.data.remote_regenerate import (META_FORMAT, RemoteConfig, check_meta, meta_path, regenerate_remote,
                                              server_urls)

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class RegenerateCommandConfig:
    """``eaglewire regenerate``: conversations -> a JSONL of regenerated ones that ``prepare --data`` reads."""

    out: str = field(metadata={"help": "the JSONL file to write (appended to: a rerun resumes)"})
    data: str = field(default="sharegpt", metadata={
        "help": "data preset (sharegpt), a ShareGPT .json / messages .jsonl file, a parquet file or a directory of "
                "them, or a datasets directory"})
    target: str = field(default=DEFAULT_TARGET, metadata={
        "help": "the target (preset, HF directory or .gguf): its tokenizer and chat template always, its "
                "weights when regenerating in this process"})
    num_conversations: int | None = field(default=None, metadata={"help": "use at most this many conversations"})
    offset: int = field(default=0, metadata={"help": "skip this many conversations first"})
    device: str = device_field("in-process: " + DEVICE_HELP)
    sampling: RegenerateConfig = field(default_factory=RegenerateConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)

    def __post_init__(self) -> None:
        if self.num_conversations is not None and self.num_conversations < 1:
            raise ValueError(f"--num-conversations must be >= 1, got {self.num_conversations}")
        if self.offset < 0:
            raise ValueError(f"--offset must be >= 0, got {self.offset}")


def run_regenerate(config: RegenerateCommandConfig, *, progress: bool = True) -> RegenerateReport:
    """The ``regenerate`` command: through the servers when any is given, else with the target here."""
    from eaglewire.model.target import load_target, load_tokenizer

    path = data_path(config.data) if config.data in DATA_PRESETS else Path(config.data)
    if not path.exists():
        raise FileNotFoundError(f"--data {config.data}: {path} does not exist; pass a preset "
                                f"({', '.join(DATA_PRESETS)}), a ShareGPT .json, a messages .jsonl, a parquet file or "
                                "a directory of them, or a datasets directory (save_to_disk)")
    conversations, loaded = load_conversations(path, limit=config.num_conversations, offset=config.offset)
    log.info("%s", loaded.summary())
    if config.remote.remote:
        tokenizer = load_tokenizer(config.target)
        with server_urls(config.remote, ctx_per_slot=config.sampling.context) as urls:
            return regenerate_remote(conversations, config.out, tokenizer=tokenizer, config=config.sampling,
                                     remote=config.remote, urls=urls, target=config.target, progress=progress)
    out = Path(config.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out.with_name(out.name + ".lock"), what=f"--out {out}"):
        target = load_target(config.target, device=config.device)
        s = config.sampling
        settings = {"mode": "in-process", "model": config.target, "target": config.target,
                    "sampling": {"temperature": s.temperature, "max_tokens": s.max_new_tokens,
                                 **({"top_p": s.top_p, "seed": s.seed, "batch_size": s.batch_size}
                                    if s.temperature > 0 else {})},
                    "max_turns": s.max_turns, "max_prompt_tokens": s.max_prompt_tokens}
        if (kwargs := config.remote.template_kwargs()) is not None:  # absent: the template's defaults, as before
            settings["chat_template_kwargs"] = kwargs
        check_meta(out, settings)
        meta = {"format": META_FORMAT, "version": 1, "settings": settings}
        atomic_write_json(meta_path(out), meta, fsync=True)
        report = regenerate(target, conversations, out, config=s, progress=progress,
                            template_kwargs=config.remote.template_kwargs())
        atomic_write_json(meta_path(out), {**meta, "report": asdict(report)}, fsync=True)
    return report
