"""What synchronous data parallel training (DDP) would have done with the same samples.

DiLoCo's claim is "nearly the loss of synchronous data parallel training, for a fraction of
the communication". To check it on a run, :func:`ddp_equivalent` replays the run's samples
as DDP would consume them: in window ``w``, inner step ``k`` takes ONE batch made of every
trainer's ``k``-th minibatch (drawn exactly as :meth:`TorchWorkload.train_window` draws it
for that trainer, from its lease and its seed), so the global batch is ``trainers x
batch_size`` and the run takes ``windows x steps`` optimizer steps with one inner optimizer
of the same configuration. Same samples, same compute, one gradient all-reduce per step.

:func:`ddp_bytes_per_worker` is what that costs each worker on the wire.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch

from p2ptrain.errors import LocalError
from p2ptrain.torch.workload import (
    TorchWorkload,
    minibatch_plan,
    scale_learning_rates,
    train_step,
)

__all__ = ["ddp_bytes_per_worker", "ddp_equivalent"]


def _fresh_copy(workload: TorchWorkload) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A copy of the workload's model at its genesis weights, and a new optimizer of the
    same type and hyper-parameters on it (no state; each group at the rate the workload's
    optimizer was built with, whatever schedule it follows now): the workload is left
    untouched."""
    model = copy.deepcopy(workload.model)
    by_name = dict(model.named_parameters())
    name_of = {id(param): name for name, param in workload.model.named_parameters()}
    with torch.no_grad():
        for name, value in workload.initial_weights().items():
            by_name[name].copy_(value)
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "lr": lr,
         "params": [by_name[name_of[id(p)]] for p in group["params"]]}
        for group, lr in zip(workload.optimizer.param_groups, workload.base_lrs, strict=True)
    ]  # fmt: skip
    optimizer_type: Callable[..., torch.optim.Optimizer] = type(workload.optimizer)
    optimizer = optimizer_type(groups)
    return model, optimizer


def ddp_equivalent(
    workload: TorchWorkload,
    windows: Sequence[Sequence[Sequence[int]]],
    *,
    steps: int,
    seed_of: Callable[[int, int], int],
    lr_scale: Callable[[int], float] | None = None,
    on_window: Callable[[int, float], None] | None = None,
) -> float:
    """The validation loss DDP reaches on the run's samples.

    ``windows[w][t]`` are trainer ``t``'s lease indices in window ``w`` (``w`` counts from
    0 here; ``seed_of(w, t)`` is the seed that trainer used). Starts from the genesis
    weights with a fresh optimizer; clips the global gradient like ``train_window``.
    ``lr_scale(window)`` (windows counted from 1, as the manifest's inner schedule counts
    them) scales the learning rate as the trainers' did in that window. ``on_window(window,
    loss)`` is told the validation loss after each window (windows counted from 1; the
    evaluation does not touch the training's state).
    """
    if not windows or any(not trainers for trainers in windows):
        raise LocalError("ddp_equivalent needs at least one window with at least one trainer")
    model, optimizer = _fresh_copy(workload)
    model.train()
    batch_size = workload.batch_size
    for w, trainers in enumerate(windows):
        if lr_scale is not None:
            scale_learning_rates(optimizer, workload.base_lrs, lr_scale(w + 1))
        plans = [
            minibatch_plan(indices, steps=steps, batch_size=batch_size, seed=seed_of(w, t))
            for t, indices in enumerate(trainers)
        ]
        for k in range(steps):
            batch = [index for plan in plans for index in plan[k]]
            train_step(
                model,
                optimizer,
                workload.collate(batch),
                batch_loss=workload.batch_loss,
                autocast_dtype=workload.autocast_dtype,
            )
        if on_window is not None and w + 1 < len(windows):
            on_window(w + 1, workload.evaluate_model(model))
    loss = workload.evaluate_model(model)
    if on_window is not None:
        on_window(len(windows), loss)
    return loss


def ddp_bytes_per_worker(
    parameters: int, steps: int, workers: int, bytes_per_value: int = 4
) -> int:
    """Bytes each worker sends for ``steps`` synchronous steps: a ring all-reduce of the
    gradient sends ``2 (N-1)/N`` times the gradient's size per step (reduce-scatter, then
    all-gather), here of ``parameters`` values of ``bytes_per_value`` bytes (fp32: 4).
    Receives are the same again; like the update blob sizes we compare it with, this counts
    one direction."""
    if workers < 1 or steps < 0 or parameters < 0:
        raise LocalError("ddp_bytes_per_worker needs workers >= 1, steps >= 0, parameters >= 0")
    return steps * 2 * (workers - 1) * parameters * bytes_per_value // workers
