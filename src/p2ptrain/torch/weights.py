"""A model's weights as the protocol sees them, and as an export needs them.

The protocol exchanges ``model.named_parameters()``: float32, one entry per parameter, a
tied parameter (a language model's shared embedding and output matrix) once, under the first
name PyTorch lists it by. Buffers are not exchanged.

An export needs more: ``model.state_dict()`` has every name, tied aliases included, and the
persistent buffers, and ``safetensors`` refuses tensors that share storage.
:func:`tied_parameters` says which names are aliases; :func:`state_dict_copies` gives the
whole state dict as separate CPU tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from p2ptrain.errors import LocalError

__all__ = ["load_weights", "parameter_names", "snapshot", "state_dict_copies", "tied_parameters"]


def parameter_names(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's parameters by name (tied parameters once), checked to be float32."""
    params = dict(model.named_parameters())
    for name, param in params.items():
        if param.dtype != torch.float32:
            raise LocalError(
                f"parameter {name!r} is {param.dtype}; p2ptrain exchanges float32 weights: "
                "keep the module in float32 (use autocast for lower-precision compute)"
            )
    if not params:
        raise LocalError("the model has no parameters to train")
    return params


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` for every parameter name that refers to a parameter listed
    earlier under another name (``canonical`` is the name in ``named_parameters()``)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(param), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def load_weights(params: Mapping[str, nn.Parameter], weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` into the parameters in place (optimizers keep their references),
    onto the parameters' device."""
    missing, extra = sorted(params.keys() - weights.keys()), sorted(weights.keys() - params.keys())
    if missing or extra:
        raise LocalError(
            f"weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}; "
            "the head was made for another model (check the experiment's workload config)"
        )
    with torch.no_grad():
        for name, param in params.items():
            value = weights[name]
            if value.shape != param.shape:
                raise LocalError(
                    f"weight {name!r} has shape {tuple(value.shape)}, the model's is "
                    f"{tuple(param.shape)}; check the experiment's workload config"
                )
            param.copy_(value)


def snapshot(params: Mapping[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Detached float32 CPU contiguous copies of the parameters."""
    return {
        name: param.detach().to("cpu", torch.float32, copy=True).contiguous()
        for name, param in params.items()
    }


def state_dict_copies(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every tensor a contiguous CPU copy in its own storage (tied
    aliases become equal copies), as ``safetensors.torch.save_file`` requires."""
    return {
        name: tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
        for name, tensor in model.state_dict().items()
    }
