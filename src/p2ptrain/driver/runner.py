"""A role runner: one role's state machine, its tasks and its failures.

The node shell holds one runner per role machine (:mod:`.trainer_runner`,
:mod:`.participant_runner`, or a plain :class:`RoleRunner` for a seed or viewer that only
follows the chain). A runner owns its tasks in its own :class:`asyncio.TaskGroup` -- never
the network layer's -- and carries out its policy's effects (:meth:`execute`): records go out
through the shared :class:`~.services.PeerServices`, fetches run as its tasks,
adoption is handed to the shell. What to do about what arrives (and about
what the machine decides) is the :mod:`~p2ptrain.protocol.policy`'s to say, the same as in
the simulator: the runner only carries out its effects and hands the outcome of each fetch
back to it. Every step runs guarded (:meth:`guard`,
:meth:`spawn`): an unexpected exception is recorded for its window in the node's
:class:`~.failures.FailureBook` and the role goes on, until too many in a row end
:meth:`run` with :class:`~.failures.RoleFailed`. No task of a role ends silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import asdict
from typing import Any

from p2ptrain.core.certificate import CertifiedLink
from p2ptrain.core.records import Attestation, Proposal
from p2ptrain.driver.clock import now as clock
from p2ptrain.driver.failures import FailureBook, RoleFailed
from p2ptrain.driver.fetches import FETCHING, answer
from p2ptrain.driver.services import PeerServices
from p2ptrain.driver.transport import Message
from p2ptrain.errors import ProtocolViolation, TransportError
from p2ptrain.observe.events import CatchingUp, NodeEvent
from p2ptrain.observe.status import RoleState, TrainerWindow
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.chain import ChainPage
from p2ptrain.protocol.effects import (
    Effect,
    Fetch,
    KeepState,
    Publish,
    StoreBlob,
    StoreRecord,
    StoreVote,
    WindowSync,
)
from p2ptrain.protocol.policy import RolePolicy, policy_for
from p2ptrain.protocol.role import RoleMachine

__all__ = ["RoleRunner"]

logger = logging.getLogger(__name__)

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
        self.policy: RolePolicy = policy_for(machine)
        self.services = services
        self.failures = failures
        self.emit = emit
        self._group: asyncio.TaskGroup | None = None
        self._fatal: RoleFailed | None = None
        self._ended = asyncio.Event()
        self._wake = asyncio.Event()
        self._queued: list[tuple[Step, str, int | None]] = []
        self._finished = False
        #: The last notice logged (each is logged once).
        self._noticed = ""
        #: Whether the role was catching up when last looked at (it is said once).
        self._behind = False
        self._handlers = self.handlers()

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
        self.execute(self.policy.start(now))

    def reason(self) -> str:
        """What the role is doing, or why it is stuck, in words (status and dashboard)."""
        return self.machine.catching_up or self.machine.last_reason

    def state(self) -> RoleState:
        return RoleState(
            role=self.role,
            last_reason=self.reason(),
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
        except Exception as exc:
            if self.services.storage.check(f"{self.role}, {step}", exc):
                return  # the disk refused a write: reported once, tried again later
            if isinstance(exc, TransportError | ProtocolViolation):
                # a network fault (the step is tried again later), or a peer's bad bytes (the
                # peer is counted against where they were proven bad): not the role's failure
                logger.warning("%s, %s: %s", self.role, step, exc)
                return
            # everything the step did not expect
            self.failed(step, self.window if window is None else window, exc)
        else:
            if self.main_step in (None, step):
                self.failures.succeeded(self.role)

    def failed(self, step: str, window: int, exc: BaseException) -> None:
        fatal = self.failures.report(
            self.role, window, step, exc, peer_id=self.services.peer_id, emit=self.emit
        )
        if fatal is not None and self._fatal is None:
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

    def receive(self, message: Message) -> None:
        """A gossip message that passed intake (or one the node's other roles published)."""
        article = "an" if message.kind[:1] in ("a", "e", "i", "o", "u") else "a"
        with self.guard(f"handling {article} {message.kind}"):
            now, record = clock(), message.record
            self.observe(now)
            if isinstance(record, CertifiedLink):
                sender = self.services.key_of(message.from_peer)
                self.execute(self.policy.certificate(now, record.head, record.certificate, sender))
            else:
                self.execute(self.policy.record(now, record, len(message.data)))

    def observe(self, now: float) -> None:
        """Tell the machine what the node saw of its peers before it acts (by default:
        nothing)."""

    def base_moved(self, adopted: act.Adopted) -> None:
        """Another role of the node adopted a head on the follower this one shares."""
        with self.guard("adopting a head"):
            self.execute(self.policy.base_moved(clock(), adopted))

    def offer_links(self, page: ChainPage) -> None:
        """A catch-up page the node's periodic sync fetched: verify and adopt its links,
        then fetch what follows."""
        with self.guard("catching up"):
            self.execute(self.policy.links(clock(), page))

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
                self.observe(clock())
                self.execute(self.policy.tick(clock()))
                now = clock()
                wakeup = machine.next_wakeup(now)
                delay = 1.0 if wakeup is None else max(0.0, wakeup - now)

    # -- carrying out the policy's effects ------------------------------------------------

    def execute(self, effects: Sequence[Effect]) -> None:
        """Carry out ``effects`` in order (the policy put what is kept before what is sent)."""
        storage = self.services.storage
        for effect in effects:
            what = type(effect).__name__
            try:
                self.do(effect)
            except Exception as exc:
                if storage.check(f"{self.role}: {what}", exc):
                    continue
                if not isinstance(exc, TransportError | ProtocolViolation | OSError):
                    raise
                logger.warning("%s: %s failed: %s", self.role, what, exc)
            else:
                if isinstance(effect, StoreBlob | KeepState | StoreRecord | StoreVote):
                    storage.succeeded()
        self._wake.set()
        self._say_catching_up()

    def _say_catching_up(self) -> None:
        """Tell the node's program (and log) once when the role starts catching up."""
        reason = self.machine.catching_up
        if bool(reason) == self._behind:
            return
        self._behind = bool(reason)
        if reason:
            logger.info("%s: %s", self.role, reason)
            self.emit(CatchingUp(peer_id=self.services.peer_id, role=self.role, reason=reason))

    def handlers(self) -> dict[type[Any], Callable[[Any], object]]:
        """How this role carries out each kind of effect: the dispatch table of :meth:`do`
        (a role adds its own, or replaces one, in its override)."""
        services = self.services
        return {
            Publish: self._send,
            StoreBlob: self._store_blob,
            KeepState: self._keep_state,
            StoreRecord: lambda e: services.remember(e.signed, e.kind, e.window),
            StoreVote: lambda e: services.store.put_vote(e.height, e.ballot),
            Fetch: lambda e: self.spawn(self._fetch(e), FETCHING[type(e.request)]),
            act.Adopted: lambda e: services.on_adopted(self.machine, e),
            act.Reported: lambda e: services.report(e.peer_id, e.reason),
            act.Notice: self._notice,
        }

    def do(self, effect: Effect) -> None:
        """Carry out one effect, as :meth:`handlers` says."""
        handler = self._handlers.get(type(effect))
        if handler is None:
            raise TypeError(f"the {self.role} role has no use for {type(effect).__name__}")
        handler(effect)

    def _store_blob(self, effect: StoreBlob) -> None:
        blobs = self.services.store.blobs
        if effect.blob_id is not None and blobs.has(effect.blob_id):
            return
        if isinstance(effect.data, bytes | bytearray):
            blobs.put(effect.data)
        else:
            blobs.adopt(effect.data)  # a spooled file: renamed, not copied

    def _keep_state(self, effect: KeepState) -> None:
        head, blobs = effect.head, self.services.store.blobs
        if blobs.has(head.weights_blob) and (
            head.optimizer_blob is None or blobs.has(head.optimizer_blob)
        ):
            return
        for blob in effect.blobs() or ():
            if blob is not None:
                blobs.put(blob)

    def _send(self, effect: Publish) -> None:
        self.services.publish(effect.kind, effect.record, again=effect.again, origin=self.role)
        if not effect.again:
            self._time_published(effect)
        self.published(effect)

    def _notice(self, effect: act.Notice) -> None:
        if effect.reason != self._noticed:  # once, until something else is said
            self._noticed = effect.reason
            logger.warning("%s: %s", self.role, effect.reason)
            peer_id = self.services.peer_id
            self.emit(CatchingUp(peer_id=peer_id, role=self.role, reason=effect.reason))

    def published(self, effect: Publish) -> None:
        """``effect`` went out (roles tell their events)."""

    def _time_published(self, effect: Publish) -> None:
        """A proposal or attestation of ours went out: the reduce or attest phase ended."""
        record = getattr(effect.record, "record", None)
        telemetry, now = self.services.telemetry, clock()
        if isinstance(record, Proposal):
            telemetry.proposed(record.window, now)
        elif isinstance(record, Attestation):
            telemetry.attested(record.height, now)

    async def _fetch(self, fetch: Fetch) -> None:
        """One try of ``fetch.request`` after its delay; the policy decides what follows."""
        if fetch.delay_s > 0:
            await asyncio.sleep(fetch.delay_s)
        request = fetch.request
        if isinstance(request, WindowSync):  # past its deadline without a certificate
            self.services.telemetry.window_failed(request.window, "deadline")
        try:
            got = await answer(self.services, lambda: self.machine.chain.height, request)
        except TransportError as exc:
            if not self.services.storage.check(f"{self.role}: {FETCHING[type(request)]}", exc):
                logger.info("%s: %s", self.role, exc)
            self.execute(self.policy.fetch_failed(clock(), request, proven_bad=False))
        except ProtocolViolation as exc:
            # nobody served bytes with the right hash; providers proven wrong were reported
            logger.warning("%s: %s", self.role, exc)
            self.execute(self.policy.fetch_failed(clock(), request, proven_bad=True))
        else:
            self.execute(self.policy.fetched(clock(), request, got))
