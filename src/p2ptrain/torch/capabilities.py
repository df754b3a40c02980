"""What a workload may do beyond :class:`~.workload.Workload`: one protocol per capability.

A node asks for a capability by type (``isinstance(workload, Placeable)``), never by name.
Where the experiment or the command needs one that the workload lacks, the node refuses
in words; elsewhere it goes without (no perplexity in an evaluation report, no dry run).
:class:`~.workload.TorchWorkload`, which every factory's parts become, has them all; a
workload class of your own declares the ones it offers by having their members (the README's
"Your own model").
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from p2ptrain.data.pipelines import DataPipeline

__all__ = [
    "DryRunnable",
    "Placeable",
    "PreparedDataUser",
    "RateScheduled",
    "ReportsEvaluation",
    "TorchModule",
    "model_config",
]


@runtime_checkable
class Placeable(Protocol):
    """``--device``: moves its model, optimizer state and batches to a device."""

    def place(self, device: torch.device | str) -> None: ...


@runtime_checkable
class DryRunnable(Protocol):
    """Runs one forward and backward pass on one batch before a node's first window and
    raises :class:`~p2ptrain.errors.LocalError` saying what to change; returns the loss."""

    def dry_run(self) -> float: ...


@runtime_checkable
class RateScheduled(Protocol):
    """Follows the experiment's inner learning-rate schedule (``[inner_optimizer]
    schedule``): the trainer sets the same factor in every trainer before each window."""

    #: each parameter group's learning rate as its optimizer was built
    @property
    def base_lrs(self) -> tuple[float, ...]: ...

    def set_lr_scale(self, scale: float) -> None: ...


@runtime_checkable
class PreparedDataUser(Protocol):
    """Trains on prepared shards (``[data] prepared``), which the node gives it as a pipeline;
    with ``val_from_data`` it also validates on the prepared data's validation split."""

    #: validates on the validation split of the data it is given (and on nothing else)
    val_from_data: bool
    #: where its training samples come from (None: not given yet)
    data: DataPipeline | None

    def use_data(self, pipeline: DataPipeline) -> None: ...

    #: why it has no validation data (None: it has some)
    @property
    def validation_missing(self) -> str | None: ...


@runtime_checkable
class ReportsEvaluation(Protocol):
    """Says more of an evaluation: a language model's loss is a token cross-entropy (an
    evaluator reports its perplexity too), and how many samples it evaluates on."""

    language_model: bool

    @property
    def validation_samples(self) -> int: ...


@runtime_checkable
class TorchModule(Protocol):
    """Trains one :class:`torch.nn.Module`: the experiment records the model's config when
    it has one (a Hugging Face model's ``config.to_dict()``), and the demo's DDP-equivalent
    baseline trains a copy of it."""

    model: nn.Module


@runtime_checkable
class _Configured(Protocol):
    config: Any


@runtime_checkable
class _DictConfig(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


def model_config(workload: object) -> dict[str, Any] | None:
    """The config of the workload's model as a dict (a Hugging Face model's), or None."""
    if not isinstance(workload, TorchModule) or not isinstance(workload.model, _Configured):
        return None
    config = workload.model.config
    return config.to_dict() if isinstance(config, _DictConfig) else None
