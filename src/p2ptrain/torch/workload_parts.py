"""A workload from its parts: what a user's factory returns when it is not a Workload.

``{"model": ..., "train": ..., "val": ..., "batch_size": 32}`` and optionally ``optimizer``
(default: AdamW, lr 1e-3, over the model's parameters), ``loss`` (``loss(model, batch)``, the
loss of a collated batch; default: cross-entropy of ``model(inputs)`` against ``targets``),
``collate`` (default :func:`torch.utils.data.default_collate`), ``samples_per_shard``
(default 64), ``name`` (the dataset's name; default: the factory's) and ``val_batches``.
``train`` is a map-style dataset (a torch ``Dataset``, a ``datasets.Dataset``), a data
pipeline (:mod:`p2ptrain.data.pipelines`: ``GeneratedData``, ``CustomData``) or None when the
experiment trains on prepared shards (``[data] prepared = "DIR"``: the node attaches them).
Unknown keys are refused by name, so a typo does not silently drop a setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from p2ptrain.core.field_rules import name_from
from p2ptrain.errors import LocalError
from p2ptrain.torch.workload import TorchWorkload

__all__ = ["PARTS", "workload_from_parts"]

#: The keys a parts mapping may hold (the first four are required).
PARTS = (
    "model",
    "train",
    "val",
    "batch_size",
    "optimizer",
    "loss",
    "collate",
    "samples_per_shard",
    "name",
    "val_batches",
    "pod_wrap",
)


def workload_from_parts(parts: Mapping[str, Any], *, where: str) -> TorchWorkload:
    """A :class:`TorchWorkload` from a factory's parts (see the module docstring)."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise LocalError(
            f"workload {where!r}: the factory returned unknown parts {unknown}; "
            f"known: {', '.join(PARTS)}"
        )
    missing = [key for key in PARTS[:4] if key not in parts]
    if missing:
        raise LocalError(
            f"workload {where!r}: the factory's dict lacks {missing}; it needs model, train, "
            "val (map-style datasets; train may be a data pipeline, or None for prepared "
            "shards) and batch_size"
        )
    model = parts["model"]
    if not isinstance(model, nn.Module):
        raise LocalError(
            f"workload {where!r}: 'model' is a {type(model).__name__}, not a torch.nn.Module"
        )
    batch_size = parts["batch_size"]
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise LocalError(
            f"workload {where!r}: 'batch_size' must be a positive int, got {batch_size!r}"
        )
    optimizer = parts.get("optimizer")
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = parts.get("loss")
    if loss is not None and not callable(loss):
        raise LocalError(f"workload {where!r}: 'loss' must be a function loss(model, batch)")
    return TorchWorkload(
        model,
        optimizer,
        parts["train"],
        parts["val"],
        batch_size=batch_size,
        samples_per_shard=int(parts.get("samples_per_shard", 64)),
        name=str(
            parts.get("name") or name_from(where.rpartition(":")[2], limit=48, fallback="dataset")
        ),
        batch_loss=loss,
        collate_fn=parts.get("collate"),
        val_batches=int(parts.get("val_batches", 8)),
        pod_wrap=str(parts.get("pod_wrap", "ddp")),
    )
