"""Where a command computes: ``--device auto|cpu|cuda[:N]``, resolved once per run, and what differs per device.

``auto`` takes CUDA where torch sees a GPU and says so (one log line naming it), the CPU elsewhere. The
CPU-only tricks (oneDNN's row-exact bf16 kernels, packed weights, thread counts) ask the device's type and
stay off a GPU; a GPU's work is timed with ``synchronize`` before the clock is read.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import field

import torch

log = logging.getLogger(__name__)

DEVICE_HELP = "auto (CUDA where torch sees a GPU, else the CPU), cpu, cuda or cuda:N"


def device_field(help_text: str = DEVICE_HELP):
    """The one ``--device`` setting of every command that computes (its default lives here)."""
    return field(default="auto", metadata={"help": help_text})


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto``: CUDA when present (said once), else the CPU; ``cuda`` without a GPU is an error that says why."""
    if isinstance(device, torch.device):
        return device
    if str(device) == "auto":
        if torch.cuda.is_available():
            _said_auto(torch.cuda.get_device_name(0))
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not one of auto, cpu, cuda, cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU build of torch" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no GPU visible"
        raise ValueError(f"--device {device}: torch {torch.__version__} sees no CUDA device ({build}); "
                         "use --device cpu, or install a CUDA build of torch on a machine with a GPU")
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


@functools.cache
def _said_auto(name: str) -> None:
    log.info("--device auto: computing on CUDA (%s); --device cpu to stay on the CPU", name)


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU): before reading a clock."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)

