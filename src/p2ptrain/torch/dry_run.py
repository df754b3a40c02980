"""One forward and backward before joining a network, so that mistakes show at once.

A model that returns a ``ModelOutput`` where a tensor is expected, a loss that is not a scalar
or not finite, a batch that is not ``(inputs, targets)``, a dataset row of strings: each would
otherwise fail inside the first window (or, for a NaN loss, train garbage and be screened out
by validators). :func:`dry_run_batch` runs one batch through the model and the loss and raises
a :class:`~p2ptrain.errors.LocalError` that says what to change. It leaves no trace: no
optimizer step, gradients cleared, buffers (BatchNorm statistics) and the global RNG restored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from p2ptrain.data.shards import MapDataset, sample_bytes
from p2ptrain.errors import LocalError
from p2ptrain.torch.batch_loss import BatchLoss, loss_problem, to_device
from p2ptrain.torch.placement import autocast_context, seeded_rng

__all__ = ["check_rows", "collate_rows", "dry_run_batch"]


def check_rows(dataset: MapDataset, indices: Sequence[int]) -> None:
    """Raise a :class:`LocalError` unless ``dataset[i]`` for each index is tensors, numbers,
    or tuples or dicts of them (what shard hashing and collation accept)."""
    for index in indices:
        sample_bytes(dataset[index], index)


def collate_rows(collate: Callable[[Sequence[int]], Any], indices: Sequence[int]) -> Any:
    """``collate(indices)``, its failure worded as a :class:`LocalError`."""
    try:
        return collate(indices)
    except (RuntimeError, TypeError, ValueError) as error:
        raise LocalError(
            f"collate_fn could not batch the training samples {list(indices)[:8]}: {error}; "
            "make the rows the same shape (pad or cut them) or pass a collate_fn that can"
        ) from error


def dry_run_batch(
    model: nn.Module,
    batch: Any,
    batch_loss: BatchLoss,
    autocast_dtype: torch.dtype | None = None,
) -> float:
    """The loss of ``batch`` after one forward and backward in training mode; checks that
    it is a finite scalar and that some parameter gets a gradient. See the module docstring
    for what is restored."""
    device = next(model.parameters()).device
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    was_training = model.training
    model.train()
    try:
        with seeded_rng(device, 0):
            with autocast_context(device, autocast_dtype):
                try:
                    loss = batch_loss(model, to_device(batch, device))
                except LocalError:
                    raise
                except Exception as exc:
                    raise LocalError(
                        f"the model or its loss failed on the first training batch (the dry "
                        f"run before joining): {type(exc).__name__}: {exc}; fix it and start "
                        "again (the traceback above this line shows where)"
                    ) from exc
            problem = loss_problem(loss)
            if problem is not None:
                raise LocalError(problem)
            value = float(loss.detach())
            if not math.isfinite(value):
                raise LocalError(
                    f"the loss of the first training batch is {value} at the genesis weights: "
                    "check the data (labels outside the model's vocabulary or classes?), the "
                    "model's initialisation and its dtype"
                )
            if not loss.requires_grad:
                raise LocalError(
                    "the loss does not depend on the model's parameters (it has no gradient): "
                    "does loss_fn/batch_loss detach it, call .item(), or run under "
                    "torch.no_grad()?"
                )
            loss.backward()  # type: ignore[no-untyped-call]
            if all(param.grad is None for param in model.parameters()):
                raise LocalError(
                    "no parameter of the model received a gradient from the loss; compute "
                    "the loss from the model's outputs"
                )
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])
        model.train(was_training)
    return value
