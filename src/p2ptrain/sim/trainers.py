"""A simulated trainer: the driver's runner, with training done by the world's workload.

The trainer's policy and effects are a node's (:class:`~p2ptrain.driver.runner.RoleRunner`
carries them out: the update's blob kept, then published through the node's services);
only ``Train`` is the simulator's: after a simulated training time the honest update, or
what an adversarial trainer sends instead (:func:`~.adversaries.trained_update`), is handed
back to the policy. ``TrainLater`` waits on the simulator's clock."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from p2ptrain.aggregate.codecs import WindowEncoders
from p2ptrain.driver.failures import FailureBook
from p2ptrain.driver.runner import RoleRunner
from p2ptrain.driver.services import PeerServices
from p2ptrain.observe.events import NodeEvent
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.effects import TrainLater
from p2ptrain.protocol.policy import TrainerPolicy
from p2ptrain.protocol.trainer import TrainerMachine
from p2ptrain.sim.adversaries import trained_update
from p2ptrain.sim.engine import Simulator
from p2ptrain.sim.outbox import Outbox, Sender
from p2ptrain.sim.workloads import SimWorkload

__all__ = ["SimTrainerRunner"]


class SimTrainerRunner(RoleRunner):
    """``training()``: whether the trainer still trains (it is up, and the run's target was
    not reached)."""

    def __init__(
        self,
        machine: TrainerMachine,
        services: PeerServices,
        emit: Callable[[NodeEvent], None],
        *,
        sim: Simulator,
        outbox: Outbox,
        workload: SimWorkload,
        sender: Callable[[], Sender],
        trainer_index: int,
        encoder: WindowEncoders,
        training: Callable[[], bool],
    ) -> None:
        self.trainer = machine
        self.sim, self.outbox, self.workload = sim, outbox, workload
        self.sender, self.trainer_index, self.encoder = sender, trainer_index, encoder
        self.training = training
        super().__init__("trainer", machine, services, FailureBook(), emit)
        assert isinstance(self.policy, TrainerPolicy)
        self.trainer_policy: TrainerPolicy = self.policy

    def handlers(self) -> dict[type[Any], Callable[[Any], object]]:
        return {
            **super().handlers(),
            act.Train: self._train,
            TrainLater: lambda e: self.sim.call_later(
                e.delay_s, functools.partial(self._due, e.train)
            ),
        }

    def _due(self, train: act.Train) -> None:
        if self.training():
            self.execute(self.trainer_policy.train_due(self.sim.now, train))

    def _train(self, action: act.Train) -> None:
        if not self.training():
            return
        delay = self.workload.train_seconds * (0.8 + 0.4 * self.sim.rng.random())
        self.sim.call_later(delay, functools.partial(self._trained, action))

    def _trained(self, action: act.Train) -> None:
        if not self.training():
            return
        result = trained_update(
            self.outbox,
            self.sender(),
            self.trainer,
            action,
            workload=self.workload,
            trainer_index=self.trainer_index,
            encoder=self.encoder,
        )
        if result is not None:
            self.execute(self.trainer_policy.trained(self.sim.now, action, *result))
