"""Training batches from stored shards (offline) or from the live target (online).

Shapes: B batch, T tokens (longest in the batch), H target hidden, k aux boundaries, K stored top-K.
Both sources produce the same batch; online mode captures the states through the
very same ``capture`` function that wrote the shards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from eaglewire.model.boundary_capture import capture
from eaglewire.core.contract import HiddenStateContract
from eaglewire.data.conversations import load_conversations, tokenize_conversation
from eaglewire.data.shards import ShardDataset, ShardError, incomplete_reason
from eaglewire.model.target import Target

log = logging.getLogger(__name__)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] long, right-padded with 0
    loss_mask: torch.Tensor  # [B, T] bool, False on padding
    aux_hidden: torch.Tensor  # [B, T, k*H]
    last_hidden: torch.Tensor | None  # [B, T, H] boundary L, pre-norm; None with top-K labels
    topk_logprobs: torch.Tensor | None = None  # [B, T, K] the target's stored top-K (shards with topk:K labels)
    topk_ids: torch.Tensor | None = None  # [B, T, K] their target ids


class Source(Protocol):
    contract: HiddenStateContract
    sequence_ids: list[str]
    lengths: list[int]

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def batch(self, indices: list[int], device: torch.device) -> Batch: ...


def pad_right(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """Stack [T_i, ...] rows into [B, length, ...], zero-padded at the end."""
    out = rows[0].new_zeros((len(rows), length, *rows[0].shape[1:]))
    for r, row in enumerate(rows):
        out[r, :row.shape[0]] = row
    return out


class ShardSource:
    """Offline: sequences and their states from a shard directory."""

    def __init__(self, data_dir: str, target: Target, *, allow: set[str] | frozenset[str] = frozenset(),
                 allow_incomplete: bool = False) -> None:
        self.dataset = ShardDataset(data_dir)
        self.contract = self.dataset.contract
        adopt_template(target, self.dataset.manifest["source"], self.contract)
        what = f"shards in {data_dir}"
        for w in self.contract.check_target(target.fingerprint, what=what, allow=allow):
            log.warning("%s: %s", what, w)
        if (why := incomplete_reason(self.dataset.manifest)) is not None:
            if not allow_incomplete:
                raise ShardError(f"{data_dir} is incomplete: {why}. Run the same `eaglewire prepare` "
                                 "command again to finish it (it resumes), or pass --allow-incomplete-data "
                                 "to train on what is there")
            log.warning("TRAINING ON INCOMPLETE DATA (--allow-incomplete-data): %s %s", data_dir, why)
        self.sequence_ids = self.dataset.sequence_ids
        self.lengths = self.dataset.lengths

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset.tokens(i)

    def batch(self, indices: list[int], device: torch.device) -> Batch:
        items = [self.dataset[i] for i in indices]
        T = max(len(it["input_ids"]) for it in items)
        # last_hidden, or topk_logprobs and topk_ids: whichever the shards store
        return Batch(**{"last_hidden": None, **{name: pad_right([it[name] for it in items], T).to(device)
                                                for name in items[0]}})


def adopt_template(target: Target, source: dict, contract: HiddenStateContract) -> None:
    """Give the target's tokenizer the chat template the data was prepared with (a
    ``--chat-template`` file or ``--template plain``), when the manifest records its text and
    the contract its hash, so that the fingerprint check compares like with like."""
    template = source.get("template") if isinstance(source, dict) else None
    text = template.get("text") if isinstance(template, dict) else None
    tok = target.tokenizer
    if not isinstance(text, str) or tok is None or getattr(tok, "chat_template", None) == text:
        return
    from eaglewire.model.target import chat_template_sha256

    probe = type("T", (), {"chat_template": text})()
    if chat_template_sha256(probe) != contract.target.chat_template_sha256:
        return  # not the template the states were captured with: let the check say so
    log.info("using the chat template the data was prepared with (%s)", template.get("name"))
    tok.chat_template = text
    target._fingerprint = None


class OnlineSource:
    """Online: tokenized conversations; states captured from the live target per batch."""

    def __init__(self, data_path, target: Target, contract: HiddenStateContract, *, limit: int | None,
                 offset: int, max_length: int) -> None:
        conversations, report = load_conversations(data_path, limit=limit, offset=offset)
        log.info("%s", report.summary())
        self.target, self.contract = target, contract
        self.sequences = []
        for conv in conversations:
            seq = tokenize_conversation(conv, target.tokenizer, max_length=max_length)
            if sum(seq.loss_mask):
                self.sequences.append(seq)
        self.sequence_ids = [s.id for s in self.sequences]
        self.lengths = [len(s.input_ids) for s in self.sequences]

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.sequences[i]
        return torch.tensor(s.input_ids), torch.tensor(s.loss_mask, dtype=torch.bool)

    def batch(self, indices: list[int], device: torch.device) -> Batch:
        ids, masks = zip(*(self.tokens(i) for i in indices))
        T = max(len(x) for x in ids)
        input_ids = pad_right(list(ids), T)  # [B, T]
        # Right padding needs no attention mask under causal attention.
        states = capture(self.target, input_ids, self.contract)
        return Batch(input_ids=input_ids.to(device), loss_mask=pad_right(list(masks), T).to(device),
                     aux_hidden=states.aux_hidden.to(device), last_hidden=states.last_hidden.to(device))
