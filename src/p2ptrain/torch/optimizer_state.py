"""The inner optimizer's state as flat named tensors, and back.

A trainer saves its inner optimizer's state (AdamW moments, step counts) with its data so
that a restart continues bit-for-bit; the state travels as a safetensors blob, so it must be
a flat ``{name: tensor}``: ``f"{parameter}/{key}"`` for every per-parameter entry, numbers
(a step count) as 0-d tensors, float64 for floats and int64 for ints.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from p2ptrain.data.shards import number_tensor
from p2ptrain.errors import LocalError

__all__ = ["flatten_optimizer_state", "restore_optimizer_state"]


def flatten_optimizer_state(
    optimizer: torch.optim.Optimizer, params: Mapping[str, nn.Parameter]
) -> dict[str, torch.Tensor]:
    """``f"{parameter}/{key}"`` for every per-parameter state entry, as CPU tensors."""
    name_of = {id(param): name for name, param in params.items()}
    flat: dict[str, torch.Tensor] = {}
    for param, state in optimizer.state.items():
        name = name_of[id(param)]
        for key, value in state.items():
            flat[f"{name}/{key}"] = _state_tensor(name, key, value)
    return flat


def restore_optimizer_state(
    optimizer: torch.optim.Optimizer,
    params: Mapping[str, nn.Parameter],
    tensors: Mapping[str, torch.Tensor],
) -> None:
    """Replace the optimizer's per-parameter state with ``tensors`` (from
    :func:`flatten_optimizer_state`); tensors move to their parameter's device, except 0-d
    ones (step counts), which PyTorch optimizers keep on the CPU."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for flat_name, tensor in tensors.items():
        name, _, key = flat_name.rpartition("/")
        if name not in params or not key:
            raise LocalError(
                f"optimizer state entry {flat_name!r:.80} names no parameter of the model; "
                "the state was saved for another model: start the inner optimizer afresh"
            )
        grouped.setdefault(name, {})[key] = tensor
    optimizer.state.clear()
    for name, entries in grouped.items():
        param = params[name]
        optimizer.state[param] = {
            key: value.detach().clone() if value.ndim == 0 else value.to(param.device).clone()
            for key, value in entries.items()
        }


def _state_tensor(name: str, key: str, value: object) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True).contiguous()
    number = number_tensor(value)
    if number is not None:
        return number
    raise LocalError(
        f"optimizer state {name}/{key} is a {type(value).__name__}, which cannot be saved as "
        "a tensor; use an optimizer whose state is tensors and numbers"
    )
