"""Capture the target's residual-stream boundaries: the one place that decides what the draft sees.

Shapes: B batch, T tokens, H target hidden size, k number of aux boundaries, V target vocab.

Boundary b < L is the *input* of decoder layer b (a forward pre-hook on layer b);
boundary L is the *output* of the last layer, before the final norm (a forward hook).
Hooks, not forks of model code, so any decoder-only transformers model works.
The capture runs the target's base model only: the lm_head (the largest matrix of a
small target) is applied later, by ``Target.head``, and only where logits are needed.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from eaglewire.core.contract import HiddenStateContract, validate_boundaries
from eaglewire.model.target import Target


@dataclass
class Capture:
    aux_hidden: torch.Tensor  # [B, T, k*H] in contract order
    last_hidden: torch.Tensor  # [B, T, H] boundary L, pre-norm


def _hidden_from_args(args: tuple, kwargs: dict) -> torch.Tensor:
    """A decoder layer's hidden-state input, passed positionally or by keyword."""
    if args:
        return args[0]
    return kwargs["hidden_states"]


def _hidden_from_output(output: Any) -> torch.Tensor:
    """Decoder layers return a tensor (transformers 5) or a tuple whose first item it is."""
    return output[0] if isinstance(output, (tuple, list)) else output


@functools.cache
def _cache_kwarg(forward) -> str:
    """transformers renames ``past_key_values`` to ``cache`` (5.x deprecation)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _forward_kwargs(decoder, attention_mask, position_ids, past_key_values, use_cache) -> dict[str, Any]:
    """Only the arguments that are set."""
    kwargs: dict[str, Any] = {"use_cache": use_cache}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if past_key_values is not None:
        kwargs[_cache_kwarg(type(decoder).forward)] = past_key_values
    return kwargs


@contextmanager
def record_boundaries(target: Target, boundaries: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, every forward of ``target`` stores ``{boundary: [B, T, H]}``."""
    num_layers = target.num_layers
    seen: dict[int, torch.Tensor] = {}
    handles = []
    for b in sorted(set(boundaries)):
        if b < num_layers:
            def pre_hook(module, args, kwargs, b=b):
                seen[b] = _hidden_from_args(args, kwargs)
            handles.append(target.layers[b].register_forward_pre_hook(pre_hook, with_kwargs=True))
        else:
            def post_hook(module, args, output, b=b):
                seen[b] = _hidden_from_output(output)
            handles.append(target.layers[num_layers - 1].register_forward_hook(post_hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()  # not inference_mode: online training feeds these tensors to autograd
def capture(target: Target, input_ids: torch.Tensor, aux_boundaries: list[int] | HiddenStateContract,
            *, attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
            past_key_values: Any = None, use_cache: bool = False) -> Capture:
    """Run the target on ``input_ids`` [B, T]; return aux states and the pre-norm last state.

    ``aux_boundaries`` is a contract or an ordered list of boundaries; the aux states
    are concatenated in that order along the hidden dimension.
    """
    if isinstance(aux_boundaries, HiddenStateContract):
        aux_boundaries = list(aux_boundaries.aux_boundaries)
    num_layers = target.num_layers
    aux_boundaries = validate_boundaries(list(aux_boundaries), num_layers)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
    with record_boundaries(target, aux_boundaries + [num_layers]) as seen:
        target.decoder(input_ids=input_ids.to(target.device),
                             **_forward_kwargs(target.decoder, attention_mask, position_ids, past_key_values,
                                               use_cache))
    aux = torch.cat([seen[b] for b in aux_boundaries], dim=-1)  # [B, T, k*H]
    # A cache passed in (past_key_values) is updated in place; the caller keeps it.
    return Capture(aux_hidden=aux, last_hidden=seen[num_layers])


def token_index(lengths: list[int], width: int) -> torch.Tensor:
    """The real tokens of a right-padded batch [B, width] as flat positions: row r's first lengths[r] -> [N]."""
    return torch.cat([torch.arange(n) + r * width for r, n in enumerate(lengths)])  # [N]


@torch.no_grad()
def capture_packed(target: Target, input_ids: torch.Tensor, lengths: list[int],
                   aux_boundaries: list[int] | HiddenStateContract) -> Capture:
    """``capture`` of a right-padded batch ``input_ids`` [B, T] whose row r holds lengths[r] real tokens,
    returned without the padding, sequences concatenated: aux_hidden [N, k*H], last_hidden [N, H],
    N = sum(lengths). Right padding needs no attention mask: with causal attention no real token attends
    to the padding after it. Nothing waits for the device: the batch's ids go over from page-locked memory
    and the padding is dropped by positions computed here."""
    if isinstance(aux_boundaries, HiddenStateContract):
        aux_boundaries = list(aux_boundaries.aux_boundaries)
    num_layers = target.num_layers
    aux_boundaries = validate_boundaries(list(aux_boundaries), num_layers)
    if input_ids.dim() != 2 or len(lengths) != input_ids.shape[0] or max(lengths) > input_ids.shape[1]:
        raise ValueError(f"input_ids must be [batch, tokens] with a length <= tokens per row, got shape "
                         f"{tuple(input_ids.shape)} and lengths {lengths}")
    B, T = input_ids.shape
    device = target.device
    index = token_index(lengths, T)  # [N]
    if device.type == "cuda":  # a copy from pageable memory would wait for the device's queue
        input_ids, index = (x.pin_memory() if torch.backends.cuda.is_built() else x for x in (input_ids, index))
    input_ids, index = (x.to(device, non_blocking=True) for x in (input_ids, index))
    with record_boundaries(target, aux_boundaries + [num_layers]) as seen:
        target.decoder(input_ids=input_ids, use_cache=False)

    def real(b: int) -> torch.Tensor:  # boundary b's states of the real tokens [N, H]
        x = seen[b]
        return x.reshape(B * T, x.shape[-1]).index_select(0, index)

    aux = torch.cat([real(b) for b in aux_boundaries], dim=-1)  # [N, k*H]
    return Capture(aux_hidden=aux, last_hidden=real(num_layers))
