"""``torch.compile`` of the draft's decoder layer for training (``--compile``): the norms and the MLP, where
fusing the elementwise work (RMSNorm's reduction and scale, SiLU x up) into few kernels saves memory traffic.
The attention (model/ttt_attention.py) stays eager.

Compiled with dynamic shapes (batches differ in length: one graph, not one per length) and tried once on a
small batch at start: if compiling fails there, the layer runs eager again and a warning says why.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def layer_modules(draft: torch.nn.Module) -> list[torch.nn.Module]:
    """What ``compile_layer`` compiles: an EAGLE-3 draft's norms and MLP, each DFlash layer's."""
    layers = [draft.midlayer] if hasattr(draft, "midlayer") else list(getattr(draft, "layers", []))
    names = ("input_layernorm", "hidden_norm", "post_attention_layernorm", "mlp")
    return [getattr(layer, n) for layer in layers for n in names if hasattr(layer, n)] + [draft.norm]


def uncompile(modules: list[torch.nn.Module]) -> None:
    for m in modules:
        m.__dict__.pop("forward", None)  # the class's eager forward again


def compile_layer(draft: torch.nn.Module, precision, *, backend: str = "inductor") -> bool:
    """Compile the draft's layer modules in place (their ``forward``; parameters and state dict untouched), run
    them forward and backward once on a small batch; on any failure put the eager forwards back, log a warning
    and return False."""
    modules = layer_modules(draft)
    for m in modules:
        m.forward = torch.compile(m.forward, dynamic=True, backend=backend)
    try:
        _try_once(modules, precision, next(draft.parameters()).device)
    except Exception as e:  # any compiler fault: training goes on eager
        uncompile(modules)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning("torch.compile of the draft's layer failed, training eager: %s: %s", type(e).__name__, first)
        return False
    log.info("compiled the draft's layer (%d modules, backend %s)", len(modules), backend)
    return True


def _try_once(modules: list[torch.nn.Module], precision, device: torch.device) -> None:
    width = modules[0].weight.shape[0]  # the hidden size (an RMSNorm's weight)
    for m in modules:
        x = torch.randn(2, 5, width, device=device, requires_grad=True)  # [B, T, H]
        with precision.autocast():
            y = m(x)
        y.float().sum().backward()
    for m in modules:
        for p in m.parameters():
            p.grad = None
