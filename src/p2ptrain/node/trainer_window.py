"""A trainer's work in one window, without the network: train, encode, save the state.

:func:`train_update` is what :class:`~p2ptrain.node.trainer_runner.TrainerRunner` runs in its
worker thread each window, and what ``p2ptrain bench trainer-memory`` measures: the inner
steps of the workload from the base weights, the pseudo-gradient ``Δ = θ_base - θ_local``, its
encoding with the experiment's codec, and the inner optimizer state handed to ``save_state``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from p2ptrain.aggregate.codecs import UpdateEncoder
from p2ptrain.errors import LocalError
from p2ptrain.node.persist import NodeStore
from p2ptrain.torch.workload import Workload

__all__ = [
    "RESIDUAL_PREFIX",
    "TrainedUpdate",
    "restore_trainer_state",
    "split_saved_state",
    "train_update",
]

logger = logging.getLogger(__name__)

#: Where the codec's error-feedback residuals sit in the saved trainer state (next to the
#: inner optimizer's tensors), so a restarted trainer sends what it had not sent yet.
RESIDUAL_PREFIX = "codec_residual/"


class TrainedUpdate(NamedTuple):
    """The update blob of a window and the losses the trainer reports with it."""

    blob: bytes
    loss_before: float
    loss_after: float
    #: Seconds inside the inner steps, and when they ended (``time.time()``).
    inner_seconds: float
    inner_ended_at: float
    #: The pseudo-gradient itself, when asked for (a trainer that trains ahead of the
    #: certified head starts its next window from it).
    delta: dict[str, torch.Tensor] | None = None


def train_update(
    workload: Workload,
    encoder: UpdateEncoder,
    base: Mapping[str, torch.Tensor],
    indices: Sequence[int],
    *,
    steps: int,
    seed: int,
    save_state: Callable[[dict[str, torch.Tensor]], None],
    keep_delta: bool = False,
) -> TrainedUpdate:
    """``steps`` inner steps from ``base`` on ``indices``, the encoded pseudo-gradient, and
    the optimizer state and the codec's residuals (under :data:`RESIDUAL_PREFIX`) passed to
    ``save_state`` once the update is encoded (and, with
    ``keep_delta``, the pseudo-gradient).

    Each copy of the weights is let go as soon as it is no longer needed (θ_local once Δ is
    computed, Δ once it is encoded): saving the state copies the optimizer's moments (twice
    the weights) and serializes them, and that is the window's memory peak.
    """
    started = time.perf_counter()
    result = workload.train_window(base, indices, steps=steps, seed=seed)
    inner_seconds, ended_at = time.perf_counter() - started, time.time()
    delta = {name: base[name] - result.weights[name] for name in base}
    loss_before, loss_after = result.loss_before, result.loss_after
    del result
    blob = encoder.encode(delta)
    kept = delta if keep_delta else None
    del delta
    state = workload.optimizer_state()
    state.update((RESIDUAL_PREFIX + name, r) for name, r in encoder.residuals().items())
    save_state(state)
    return TrainedUpdate(blob, loss_before, loss_after, inner_seconds, ended_at, kept)


def split_saved_state(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A saved trainer state as (the inner optimizer's tensors, the codec's residuals by
    parameter name): what ``save_state`` was given, taken apart again after a restart."""
    optimizer, residuals = {}, {}
    for name, tensor in tensors.items():
        if name.startswith(RESIDUAL_PREFIX):
            residuals[name.removeprefix(RESIDUAL_PREFIX)] = tensor
        else:
            optimizer[name] = tensor
    return optimizer, residuals


def restore_trainer_state(
    store: NodeStore, experiment_id: str, workload: Workload, encoder: UpdateEncoder
) -> None:
    """After a restart: the inner optimizer state and the codec's residuals the trainer saved
    in its own data directory (never bytes from a peer), if saved for this experiment."""
    loaded = store.load_trainer_state()
    if loaded is None:
        return
    tensors, metadata = loaded
    if metadata.get("experiment") != experiment_id:
        logger.warning("ignoring a trainer state saved for another experiment")
        return
    optimizer, residuals = split_saved_state(tensors)
    workload.load_optimizer_state(optimizer)
    try:
        encoder.load_residuals(residuals)
    except LocalError as exc:
        logger.warning("starting the codec's error feedback from zero: %s", exc)
    logger.info(
        "inner optimizer state%s restored (window %s)",
        " and error-feedback residuals" if residuals else "",
        metadata.get("window"),
    )
