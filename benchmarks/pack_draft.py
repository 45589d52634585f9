"""Write a draft in fp16 for shipping (the package's `reference` draft).

    python benchmarks/pack_draft.py DRAFT_DIR OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from eaglewire.model.checkpoint import load_draft, save_draft


def main(src: str, out: str) -> None:
    draft, contract, config = load_draft(src)
    save_draft(out, draft, contract, config.get("training"), dtype=torch.float16)
    size = (Path(out) / "model.safetensors").stat().st_size
    print(f"{out}: {size / 2**20:.1f} MiB (fp16)")


if __name__ == "__main__":
    main(*sys.argv[1:3])
