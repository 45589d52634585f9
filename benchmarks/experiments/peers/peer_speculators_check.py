"""Peer check: speculators' own EAGLE-3 model class on an eaglewire speculators export.

Runs in a separate environment, because speculators 0.9 pins transformers <= 5.19:

    python3 -m venv peer-venv
    peer-venv/bin/pip install torch==2.13.0 'speculators==0.9.*' 'transformers<=5.19'
    peer-venv/bin/pip uninstall -y torchvision torchaudio   # pip's builds do not match torch 2.13
    peer-venv/bin/python benchmarks/experiments/peers/peer_speculators_check.py --draft EXPORT_DIR \
        --inputs inputs.safetensors --out logits.safetensors [--create NEW_DIR]

Imports only speculators, torch, transformers and safetensors (never eaglewire).

1. Loads EXPORT_DIR with ``Eagle3DraftModel.from_pretrained`` (eager attention), checks
   that every tensor in the export landed in the model unchanged, runs its TTT forward on
   the inputs and saves the draft logits of each step as ``step{j}``.
2. With ``--create NEW_DIR``: re-draws every draft weight (not the embedding) with a fixed
   seed, writes the model with speculators' own ``save_pretrained`` (a checkpoint that
   speculators made) and saves that model's logits as ``created_step{j}``.

Inputs: ``hidden_states`` [1, T, k*H] aux states, ``input_ids`` [1, T], ``position_ids`` [1, T].
The speculator's verifier ``name_or_path`` must be a local directory with the target's
config.json (speculators reads the layer count from it; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger("peer_speculators_check")


def load_speculator(path: Path):
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    config = Eagle3SpeculatorConfig.from_pretrained(str(path))
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a GPU compile
    model = Eagle3DraftModel.from_pretrained(str(path), config=config, dtype=torch.float32)
    return model.eval()


def check_loaded(model, path: Path) -> list[str]:
    """Problems: exported tensors the model lacks or holds with other values."""
    state = model.state_dict()
    problems = []
    for name, tensor in load_file(str(path / "model.safetensors")).items():
        if name not in state:
            problems.append(f"{name}: not a tensor of Eagle3DraftModel")
        elif state[name].shape != tensor.shape or not torch.equal(state[name].to(tensor.dtype), tensor):
            problems.append(f"{name}: loaded with other values or shape")
    return problems


def draft_logits(model, inputs: dict[str, torch.Tensor], steps: int) -> list[torch.Tensor]:
    """Logits [1, T, Vd] of each TTT step, captured at lm_head."""
    captured: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().clone()))
    try:
        with torch.no_grad():
            model(hidden_states=inputs["hidden_states"], input_ids=inputs["input_ids"],
                  document_ids=torch.zeros_like(inputs["input_ids"]), position_ids=inputs["position_ids"],
                  ttt_steps=steps)
    finally:
        handle.remove()
    return captured


def redraw_weights(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("embed_tokens", "verifier_")):
                continue
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", type=Path, required=True, help="an eaglewire speculators export")
    parser.add_argument("--inputs", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3, help="TTT steps to compare")
    parser.add_argument("--create", type=Path, help="also write a checkpoint made by speculators here")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(2)

    inputs = load_file(str(args.inputs))
    model = load_speculator(args.draft)
    problems = check_loaded(model, args.draft)
    if problems:
        log.error("speculators did not load the export as written:\n  %s", "\n  ".join(problems))
        return 1
    out = {f"step{j}": t for j, t in enumerate(draft_logits(model, inputs, args.steps))}
    if args.create is not None:
        redraw_weights(model, args.seed)
        model.save_pretrained(str(args.create))
        out.update({f"created_step{j}": t for j, t in enumerate(draft_logits(model, inputs, args.steps))})
    save_file({k: v.contiguous() for k, v in out.items()}, str(args.out))
    log.info("wrote %s", ", ".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
