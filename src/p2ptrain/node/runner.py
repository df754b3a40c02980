"""A role runner: one role's state machine, its tasks and its failures.

The node shell holds one runner per role machine (:mod:`.trainer_runner`,
:mod:`.participant_runner`, or a plain :class:`RoleRunner` for a seed or viewer that only
follows the chain). A runner owns its tasks in its own :class:`asyncio.TaskGroup` -- never
the network layer's -- and carries out what its machine returns (:meth:`carry_out`):
records go out through the shared :class:`~.services.PeerServices`, fetches run as its tasks,
adoption is handed to the shell. Every step runs guarded (:meth:`guard`,
:meth:`spawn`): an unexpected exception is recorded for its window in the node's
:class:`~.failures.FailureBook` and the role goes on, until too many in a row end
:meth:`run` with :class:`~.failures.RoleFailed`. No task of a role ends silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import asdict
from typing import Any

from p2ptrain.core.certificate import CertifiedLink
from p2ptrain.core.identity import peer_id_of
from p2ptrain.errors import ProtocolViolation, TransportError
from p2ptrain.net.gossip import Delivered
from p2ptrain.node.events import NodeEvent, RoleFailure
from p2ptrain.node.failures import FailureBook, RoleFailed
from p2ptrain.node.services import PeerServices
from p2ptrain.node.status import RoleState, TrainerWindow
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.role import RoleMachine

__all__ = ["FETCH_ATTEMPTS", "RoleRunner"]

logger = logging.getLogger(__name__)

FETCH_ATTEMPTS = 6

Step = Coroutine[Any, Any, None]


class _RoleEnded(Exception):
    """Ends a role's task group once the role failed too often."""


class RoleRunner:
    """Runs one role machine. Subclasses add the role's own actions and tasks."""

    #: The step whose success clears the failures in a row (None: any guarded step).
    main_step: str | None = None
    #: A trainer's last trained window, for the status (None for the other roles).
    last_trained: TrainerWindow | None = None

    def __init__(
        self,
        role: str,
        machine: RoleMachine,
        services: PeerServices,
        failures: FailureBook,
        emit: Callable[[NodeEvent], None],
    ) -> None:
        self.role = role
        self.machine = machine
        self.services = services
        self.failures = failures
        self.emit = emit
        self._group: asyncio.TaskGroup | None = None
        self._fatal: RoleFailed | None = None
        self._ended = asyncio.Event()
        self._wake = asyncio.Event()
        self._fetching: set[str] = set()
        self._queued: list[tuple[Step, str, int | None]] = []
        self._finished = False

    # -- life cycle -----------------------------------------------------------------------

    async def run(self) -> None:
        """Run the role's tasks until cancelled; raise :class:`RoleFailed` once too many
        steps failed in a row."""
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                queued, self._queued = self._queued, []
                for step, name, window in queued:
                    self.spawn(step, name, window)
                for name, step in self.forever():
                    group.create_task(self._guarded(step, name), name=f"{self.role}-{name}")
                if self.machine.next_wakeup(time.monotonic()) is not None:
                    group.create_task(self._tick_forever(), name=f"{self.role}-tick")
                await self._ended.wait()
                raise _RoleEnded  # cancels the role's tasks
        except* _RoleEnded:
            pass
        finally:
            self._group, self._finished = None, True  # what arrives later is not started
        assert self._fatal is not None
        raise self._fatal

    def forever(self) -> Iterator[tuple[str, Step]]:
        """The role's own long-running tasks."""
        return iter(())

    def start(self, now: float) -> None:
        """The node is up and restored; begin (a trainer trains its first window)."""

    def state(self) -> RoleState:
        return RoleState(
            role=self.role,
            last_reason=self.machine.last_reason,
            failures_in_a_row=self.failures.in_a_row(self.role),
            statistics=asdict(self.machine.statistics()),
        )

    @property
    def window(self) -> int:
        """The window the role works on (the one after its canonical head)."""
        return self.machine.base.head.height + 1

    # -- guarded steps --------------------------------------------------------------------

    @contextlib.contextmanager
    def guard(self, step: str, window: int | None = None) -> Iterator[None]:
        """Record an unexpected exception of ``step`` as its window's error and go on."""
        try:
            yield
        except (TransportError, ProtocolViolation) as exc:
            # a network fault (the step is tried again later), or a peer's bad bytes (the
            # peer is counted against where they were proven bad): not the role's failure
            logger.warning("%s, %s: %s", self.role, step, exc)
        except Exception as exc:  # everything the step did not expect
            self.failed(step, self.window if window is None else window, exc)
        else:
            if self.main_step in (None, step):
                self.failures.succeeded(self.role)

    def failed(self, step: str, window: int, exc: BaseException) -> None:
        error = self.failures.failed(self.role, window, step, exc)
        event = RoleFailure(
            peer_id=self.services.peer_id,
            role=self.role,
            window=error.window,
            step=step,
            error=error.error,
            message=error.message,
            failures=self.failures.in_a_row(self.role),
            limit=self.failures.limit,
        )
        try:
            self.emit(event)
        except Exception:  # telling failed too (a closed stdout): the record stays
            logger.exception("%s: the role_error event could not be sent", self.role)
        fatal = self.failures.exhausted(self.role)
        if fatal is not None and self._fatal is None:
            fatal.__cause__ = exc
            self._fatal = fatal
            self._ended.set()

    async def _guarded(self, step: Step, name: str, window: int | None = None) -> None:
        with self.guard(name, window):
            await step

    def spawn(self, step: Step, name: str, window: int | None = None) -> None:
        """Run ``step`` as a task of this role (guarded; it ends with the role)."""
        if self._group is None and not self._finished:  # before run(): started by it
            self._queued.append((step, name, window))
            return
        if self._group is None or self._ended.is_set():
            step.close()
            return
        guarded = self._guarded(step, name, window)
        try:
            self._group.create_task(guarded, name=f"{self.role}-{name}")
        except RuntimeError:  # the role is shutting down: nothing new starts
            guarded.close()
            step.close()

    # -- inputs ---------------------------------------------------------------------------

    def receive(self, message: Delivered) -> None:
        """A verified gossip message (or one of the node's other roles published)."""
        article = "an" if message.kind[:1] in ("a", "e", "i", "o", "u") else "a"
        with self.guard(f"handling {article} {message.kind}"):
            record = message.record
            if isinstance(record, CertifiedLink):
                sender = self.services.key_of(message.from_peer)
                self.carry_out(
                    self.machine.receive_certificate(
                        time.monotonic(), record.head, record.certificate, sender
                    )
                )
            else:
                self.receive_record(message, record.record)

    def receive_record(self, message: Delivered, record: Any) -> None:
        """An update, proposal or attestation: for the roles that want them."""

    def offer_chain(
        self, links: Any, weights: bytes, optimizer: bytes | None, sender: bytes
    ) -> None:
        """A verified-by-hash catch-up answer: adopt what lies above our chain."""
        height = self.machine.chain.height
        above = [(h, c) for h, c in links if h.height > height]
        if not above:
            return
        with self.guard("catching up"):
            self.carry_out(
                self.machine.receive_chain(time.monotonic(), above, weights, optimizer, sender)
            )

    async def _tick_forever(self) -> None:
        """Tick the machine when it asked to be ticked, or sooner when something arrived;
        a tick that raised is recorded and tried again within a second."""
        machine = self.machine
        delay = 0.0
        while True:
            self._wake.clear()
            # not asyncio.wait_for: on 3.11 it can swallow a cancellation that arrives as
            # the event is set, and the node would never stop
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            delay = 1.0
            with self.guard("tick"):
                self.carry_out(machine.tick(time.monotonic()))
                now = time.monotonic()
                wakeup = machine.next_wakeup(now)
                delay = 1.0 if wakeup is None else max(0.0, wakeup - now)

    # -- carrying out the machine's actions -----------------------------------------------

    def carry_out(self, actions: Sequence[act.Action]) -> None:
        for action in actions:
            try:
                self.do(action)
            except (TransportError, ProtocolViolation, OSError) as exc:
                logger.warning("%s: %s failed: %s", self.role, type(action).__name__, exc)
        self._wake.set()

    def do(self, action: act.Action) -> None:
        """Carry out one action (subclasses take their role's own first)."""
        services = self.services
        if isinstance(action, act.SendCertificate):
            services.publish_certificate(action.head, action.certificate)
        elif isinstance(action, act.FetchState):
            self.spawn(self._fetch_state(action), "fetching a head's weights")
        elif isinstance(action, act.FetchChain):
            address = services.net.address_of(peer_id_of(action.peer))
            self.spawn(self.catch_up(address), "catching up")
        elif isinstance(action, act.Adopted):
            services.on_adopted(self.machine, action)
            self.adopted(action)
        elif isinstance(action, act.Reported):
            services.report(action.peer_id, action.reason)
        else:
            raise TypeError(f"the {self.role} role has no use for {type(action).__name__}")

    def adopted(self, action: act.Adopted) -> None:
        """The machine moved to a new canonical head (after the shell stored it)."""

    async def catch_up(self, address: str | None = None) -> None:
        answer = await self.services.fetch_chain(lambda: self.machine.chain.height, address)
        if answer is not None:
            self.offer_chain(*answer)

    async def _fetch_state(self, action: act.FetchState) -> None:
        head, head_id = action.head, action.head_id
        if head_id in self._fetching:
            return
        self._fetching.add(head_id)
        first = [] if action.peer is None else [peer_id_of(action.peer)]
        try:
            for attempt in range(FETCH_ATTEMPTS * 2):
                machine = self.machine
                if machine.chain.tip.head_id != head_id or machine.base.head_id == head_id:
                    return
                try:
                    weights, optimizer = await self.services.fetch_head_blobs(head, first)
                except (TransportError, ProtocolViolation) as exc:
                    logger.info("weights of head %s: %s", head_id[:12], exc)
                    await asyncio.sleep(min(5.0, 0.25 * 2**attempt))
                    continue
                self.carry_out(machine.receive_state(time.monotonic(), head_id, weights, optimizer))
                return
        finally:
            self._fetching.discard(head_id)
