"""Native draft checkpoints: ``config.json`` (draft architecture, contract, training
summary) + ``model.safetensors`` (draft tensors incl. d2t/t2d; never the embeddings).
The contract's family says which draft it is (EAGLE-3 when a contract predates families).

Every write goes to a temporary file first and is renamed into place, so a crash never
leaves a half-written checkpoint behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eaglewire.core.contract import ContractError, HiddenStateContract
from eaglewire.model.dflash import DFlashConfig, DFlashDraft
from eaglewire.model.draft import DraftConfig, Eagle3Draft
from eaglewire.core.errors import read_json_object, reading
from eaglewire.core.fileio import atomic_save_safetensors, atomic_write_json
from eaglewire.core.presets import resolve_draft

CHECKPOINT_FORMAT = "eaglewire-eagle3"
CHECKPOINT_VERSION = 1

# family -> (module class, its config class)
FAMILY_CLASSES = {"eagle3": (Eagle3Draft, DraftConfig), "dflash": (DFlashDraft, DFlashConfig)}

DAMAGED_DRAFT = "the draft directory is damaged (a cut copy or download?): copy it again, or export it again"


def draft_family(draft) -> str:
    return getattr(draft, "family", "eagle3")


def family_of(contract: HiddenStateContract) -> str:
    """A draft contract's family; one written before families existed is EAGLE-3."""
    return contract.family or "eagle3"


def save_draft(out_dir: str | Path, draft: Eagle3Draft | DFlashDraft, contract: HiddenStateContract,
               training: dict[str, Any] | None = None, *, dtype: torch.dtype | None = None) -> Path:
    """Write a draft directory; ``dtype`` casts floating tensors (e.g. fp16 for shipping)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in draft.state_dict().items()}
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    atomic_save_safetensors(state, out / "model.safetensors", metadata={"format": "pt"})
    contract = contract.for_family(draft_family(draft))
    config = {"format": CHECKPOINT_FORMAT, "format_version": CHECKPOINT_VERSION,
              "architectures": [type(draft).__name__], "draft": draft.config.to_dict(),
              "contract": contract.to_dict(), "training": training or {}}
    atomic_write_json(out / "config.json", config)
    return out


def read_draft_config(path: str | Path) -> dict[str, Any]:
    path = resolve_draft(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path} is not a draft directory: no config.json "
                                "(train one with `eaglewire train`, or import one with `eaglewire import`)")
    config = read_json_object(cfg_path, DAMAGED_DRAFT)
    if config.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{cfg_path} is not an eaglewire draft (format {config.get('format')!r}); "
                         "to use a SGLang, SpecForge, speculators or EAGLE checkpoint, convert it "
                         "with `eaglewire import`")
    return config


@dataclass(frozen=True)
class DraftFiles:
    """A native draft directory as read once: its config.json, contract and DraftConfig (the
    tensors on demand). The one reader of a draft directory: loading, every export and the
    llama.cpp export start from it."""

    path: Path
    config: dict[str, Any]
    contract: HiddenStateContract
    draft_config: DraftConfig | DFlashConfig

    @property
    def family(self) -> str:
        return family_of(self.contract)

    @property
    def target_spec(self) -> str | None:
        """The target the draft was trained against, as training recorded it."""
        return (self.config.get("training") or {}).get("target")

    def state(self) -> dict[str, torch.Tensor]:
        weights = self.path / "model.safetensors"
        with reading(weights, DAMAGED_DRAFT):
            return load_file(str(weights))


def read_draft(path: str | Path) -> DraftFiles:
    """Read a native draft directory (a preset name is resolved); ContractError when its
    DraftConfig and its contract disagree on the number of fused states."""
    path = resolve_draft(path)
    config = read_draft_config(path)
    contract = HiddenStateContract.from_dict(config["contract"])
    draft_config = FAMILY_CLASSES[family_of(contract)][1].from_dict(config["draft"])
    if draft_config.num_aux != contract.num_aux:
        raise ContractError(f"draft {path} fuses {draft_config.num_aux} states but its contract "
                            f"lists {contract.num_aux} boundaries")
    return DraftFiles(path=Path(path), config=config, contract=contract, draft_config=draft_config)


def load_draft(path: str | Path, *, target=None, allow: set[str] | frozenset[str] = frozenset(),
               device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load a draft directory -> (draft, contract, config dict).

    With ``target``, the contract is checked against the target's fingerprint: a
    different target is a ContractError naming the differing fields (``allow`` lets
    deliberate differences through as warnings).
    """
    files = read_draft(path)
    if target is not None:
        files.contract.check_target(target.fingerprint, what=f"draft {files.path}", allow=allow)
    draft = FAMILY_CLASSES[files.family][0](files.draft_config)
    missing, unexpected = draft.load_state_dict(files.state(), strict=False)
    if missing or unexpected:
        raise ValueError(f"draft {files.path}: tensors missing {missing}, unexpected {unexpected}")
    return draft.to(device=device, dtype=dtype).eval(), files.contract, files.config
