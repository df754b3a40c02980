"""What every role's window state machine offers its driver (the node or the simulator).

A driver holds one machine per role and treats them alike: it hands each the certified
heads, states and chains that arrive, ticks it at :meth:`RoleMachine.next_wakeup`, and shows
:meth:`RoleMachine.statistics` and :attr:`RoleMachine.last_reason` to a person. No driver
needs to know which machine it holds to do that; what differs (a trainer's training, a
participant's updates and proposals) arrives as actions (:mod:`.actions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.records import Head
from p2ptrain.core.spool import Blob
from p2ptrain.protocol.actions import Action
from p2ptrain.protocol.chain import ChainPage, HeadChain
from p2ptrain.protocol.follower import FollowerStatistics
from p2ptrain.protocol.reduction import BaseState

__all__ = ["RoleMachine"]


class RoleMachine(Protocol):
    """A role's state machine: a :class:`~.follower.Follower` (seeds, viewers) or a
    :class:`~.follower.ChainRole` over one."""

    @property
    def chain(self) -> HeadChain: ...

    @property
    def base(self) -> BaseState: ...

    @property
    def outer_steps(self) -> int:
        """Outer steps the machine took (applying certified aggregates)."""
        ...

    @property
    def last_reason(self) -> str:
        """What the machine is doing, or why the open window has no head yet."""
        ...

    def receive_certificate(
        self, now: float, head: Head, certificate: QuorumCertificate, sender: bytes
    ) -> list[Action]: ...

    def receive_state(
        self, now: float, head_id: str, weights_blob: bytes, optimizer_blob: bytes | None
    ) -> list[Action]: ...

    def receive_chain(
        self,
        now: float,
        links: Sequence[tuple[Head, QuorumCertificate]],
        weights_blob: bytes,
        optimizer_blob: bytes | None,
        sender: bytes,
    ) -> list[Action]: ...

    def receive_links(self, now: float, page: ChainPage) -> list[Action]:
        """A catch-up page: its links verified and adopted, then what follows."""
        ...

    def state_unavailable(self, head: Head, head_id: str) -> list[Action]: ...

    def resume_catch_up(self) -> list[Action]: ...

    @property
    def catching_up(self) -> str:
        """Where catch-up stands, for people ("" when the base is at the tip)."""
        ...

    def receive_aggregate(
        self, now: float, head_id: str, aggregate_blob: bytes
    ) -> list[Action]: ...

    def state_of(
        self, head_id: str
    ) -> tuple[bytes | bytearray, bytes | bytearray | None] | None: ...

    def aggregate_of(self, head_id: str) -> Blob | None: ...

    def next_wakeup(self, now: float) -> float | None:
        """When :meth:`tick` next has something to do (None: only inputs move it)."""
        ...

    def tick(self, now: float) -> list[Action]: ...

    def on_base(self, now: float) -> list[Action]:
        """Another role of the node moved the shared follower's base."""
        ...

    def statistics(self) -> FollowerStatistics:
        """A frozen record: the chain's counts, and the role's own (a subclass of it)."""
        ...
