"""How a collated batch becomes a loss, and one inner optimizer step on it.

A :class:`~p2ptrain.torch.workload.TorchWorkload` computes the loss of a batch with a
:data:`BatchLoss`, ``batch_loss(model, batch) -> scalar tensor``, whatever the batch's shape:
a dict of tensors for a Hugging Face model (``model(**batch).loss``), a pair for a plain
classifier. The common case, ``(inputs, targets)`` batches and ``loss_fn(model(inputs),
targets)``, is :class:`PairLoss`.

Mistakes that would otherwise surface as an ``AttributeError`` deep inside a loss function
(the model returned a ``ModelOutput``, the batch is a dict, the loss is not a scalar) raise
:class:`~p2ptrain.errors.LocalError` saying what to change; :func:`loss_problem` and
:func:`output_problem` word them, and :mod:`p2ptrain.torch.dry_run` reuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from p2ptrain.errors import LocalError
from p2ptrain.torch.placement import autocast_context

__all__ = [
    "CLIP_NORM",
    "BatchLoss",
    "Collate",
    "LossFn",
    "PairLoss",
    "cross_entropy_loss",
    "inner_step",
    "loss_problem",
    "output_problem",
    "split_pair",
    "to_device",
    "train_step",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: The loss of a collated batch: ``batch_loss(model, batch)``, a scalar tensor.
BatchLoss = Callable[[nn.Module, Any], torch.Tensor]
Collate = Callable[[list[Any]], Any]

#: Gradients are clipped to this global norm before every inner step.
CLIP_NORM = 1.0

_HF_HINT = (
    "for a Hugging Face causal LM use the hf-causal-lm workload (p2ptrain.torch.hf_causal_lm), "
    "or pass batch_loss=lambda model, batch: model(**batch).loss"
)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` ``[B, T, V]`` against ``targets`` ``[B, T]``, or
    ``[B, C]`` against ``[B]``."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (also inside tuples, lists and dicts) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(part, device) for part in batch)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    return batch


def _describe(value: object) -> str:
    if isinstance(value, Mapping):
        keys = ", ".join(repr(key) for key in list(value)[:6])
        return f"a {type(value).__name__} with keys [{keys}]"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def split_pair(batch: Any) -> tuple[Any, torch.Tensor]:
    """``(inputs, targets)`` of a pair batch, or a :class:`LocalError` saying what to do."""
    if isinstance(batch, tuple | list) and len(batch) == 2:
        return batch[0], batch[1]
    hint = f"; {_HF_HINT}" if isinstance(batch, Mapping) else ""
    raise LocalError(
        f"a training batch must be (inputs, targets) unless batch_loss is given, got "
        f"{_describe(batch)}: make the dataset return pairs, pass a collate_fn that builds "
        f"them, or pass batch_loss=lambda model, batch: <scalar loss>{hint}"
    )


def output_problem(outputs: object) -> str:
    """Why ``loss_fn`` cannot take the model's ``outputs`` (which are not a tensor)."""
    name = type(outputs).__name__
    if isinstance(outputs, Mapping) or hasattr(outputs, "logits"):
        return f"the model returned {name}, not a tensor of logits: {_HF_HINT}"
    return (
        f"the model returned {_describe(outputs)}, not a tensor: make forward() return the "
        f"logits, or pass a loss_fn (or batch_loss) that takes the {name}"
    )


def loss_problem(loss: object) -> str | None:
    """What is wrong with a loss value, or None when it is a one-element tensor."""
    if not isinstance(loss, torch.Tensor):
        if hasattr(loss, "loss"):
            return (
                f"the loss is a {type(loss).__name__}, not a tensor: return its .loss "
                "(batch_loss=lambda model, batch: model(**batch).loss)"
            )
        return (
            f"the loss is {_describe(loss)}, not a tensor: loss_fn and batch_loss must "
            "return a scalar tensor"
        )
    if loss.numel() != 1:
        return (
            f"the loss has shape {list(loss.shape)}, not a scalar: reduce it in loss_fn or "
            "batch_loss (e.g. .mean())"
        )
    return None


@dataclass(frozen=True)
class PairLoss:
    """The :data:`BatchLoss` of ``(inputs, targets)`` batches: ``loss_fn(model(inputs),
    targets)``."""

    loss_fn: LossFn

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = split_pair(batch)
        outputs = model(inputs)
        try:
            return self.loss_fn(outputs, targets)
        except (AttributeError, TypeError) as error:
            if isinstance(outputs, torch.Tensor):
                raise
            raise LocalError(output_problem(outputs)) from error


def inner_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    batch_loss: BatchLoss,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One inner step: forward (under autocast when ``autocast_dtype`` is set), backward,
    clip the global gradient norm to :data:`CLIP_NORM`, step. Returns the detached loss
    before the step, on the model's device (reading it would wait for the device)."""
    device = next(model.parameters()).device
    batch = to_device(batch, device)
    with autocast_context(device, autocast_dtype):
        loss = batch_loss(model, batch)
    problem = loss_problem(loss)
    if problem is not None:
        raise LocalError(problem)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    optimizer.step()
    return loss.detach().float().reshape(())


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    batch_loss: BatchLoss | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> float:
    """One inner step on a collated batch, its loss by ``batch_loss(model, batch)`` or, for
    ``(inputs, targets)`` batches, ``loss_fn(model(inputs), targets)`` (default
    :func:`cross_entropy_loss`). Returns the loss before the step."""
    if batch_loss is not None and loss_fn is not None:
        raise LocalError("pass loss_fn or batch_loss, not both")
    chosen = batch_loss or PairLoss(loss_fn or cross_entropy_loss)
    return float(inner_step(model, optimizer, batch, chosen, autocast_dtype))
