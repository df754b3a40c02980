"""Failures that show: what a role does when one of its steps raises something unexpected.

A step (training a window, a participant's tick, handling a record, a fetch) that raises an
exception nobody expected -- not a transport fault, not a peer's bad bytes, which the steps
handle themselves -- is recorded as that window's :class:`RoleError`: logged with its
traceback, shown in ``p2ptrain status`` and sent as a ``role_error`` event. The role goes on
with the next window. A success of the role's main step (a trained window, a tick) clears
the count; ``limit`` failures in a row end the node with :class:`RoleFailed`, which names the
role, the last error and what to do, and carries the last exception as its cause.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from p2ptrain.errors import LocalError
from p2ptrain.observe.events import NodeEvent, RoleFailure
from p2ptrain.observe.status import RoleError

__all__ = ["DEFAULT_MAX_FAILURES", "EndsTheNode", "FailureBook", "RoleFailed"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_FAILURES = 3
#: Role errors a node keeps to show (the oldest go first).
_KEPT = 10

_ADVICE = {
    "trainer": "check the workload (the model's forward pass, the loss function, the data "
    "loader's samples) with the traceback in the log",
}


class RoleFailed(LocalError):
    """A role failed ``limit`` steps in a row; the node stopped."""

    exit_code = 3

    def __init__(
        self,
        role: str,
        errors: list[RoleError],
        limit: int,
        *,
        ended: EndsTheNode | None = None,
    ) -> None:
        last = errors[-1]
        windows = ", ".join(str(w) for w in dict.fromkeys(e.window for e in errors))
        advice = _ADVICE.get(role, "the traceback is in the log")
        if ended is not None:
            message = f"the {role} role failed in window {last.window}: {ended}"
        else:
            message = (
                f"the {role} role failed {limit} times in a row (windows {windows}); last "
                f"error in window {last.window} while {last.step}: {last.error}: "
                f"{last.message}. The node stopped: fix the cause ({advice}) and start it "
                "again on the same data directory (--max-role-failures N tolerates more "
                "failures in a row)"
            )
        super().__init__(message)
        if ended is not None:
            self.__cause__ = ended
        self.role = role
        self.error = last


class EndsTheNode(LocalError):
    """A step's failure after which its role cannot go on in this process (a pod whose rank
    died): it is recorded as the window's failure like any other, and then the node stops
    with it at once (its supervisor, such as torchrun, may start it again)."""

    exit_code = 3


class FailureBook:
    """The role errors of one node, and each role's failures in a row."""

    def __init__(self, limit: int = DEFAULT_MAX_FAILURES) -> None:
        if limit < 1:
            raise LocalError(f"max role failures {limit}: use 1 or more")
        self.limit = limit
        self.recent: deque[RoleError] = deque(maxlen=_KEPT)
        self._in_a_row: dict[str, list[RoleError]] = {}
        #: Every role error since the node started.
        self.total = 0

    def failed(self, role: str, window: int, step: str, exc: BaseException) -> RoleError:
        """Record ``exc``; the caller ends the role once :meth:`exhausted` says so."""
        error = RoleError(
            role=role,
            window=window,
            step=step,
            error=type(exc).__name__,
            message=str(exc) or repr(exc),
            at=time.time(),
        )
        logger.error(
            "%s, window %d, %s: %s: %s", role, window, step, error.error, error.message,
            exc_info=exc,
        )  # fmt: skip
        self.recent.append(error)
        self.total += 1
        self._in_a_row.setdefault(role, []).append(error)
        return error

    def report(
        self,
        role: str,
        window: int,
        step: str,
        exc: BaseException,
        *,
        peer_id: str,
        emit: Callable[[NodeEvent], None],
    ) -> RoleFailed | None:
        """Record ``exc`` (:meth:`failed`), tell ``emit`` (a ``role_error`` event), and
        return the error that ends the node once ``role`` failed too often in a row (its
        cause: ``exc``), else None."""
        error = self.failed(role, window, step, exc)
        event = RoleFailure(
            peer_id=peer_id,
            role=role,
            window=error.window,
            step=step,
            error=error.error,
            message=error.message,
            failures=self.in_a_row(role),
            limit=self.limit,
        )
        try:
            emit(event)
        except Exception:  # telling failed too (a closed stdout): the record stays
            logger.exception("%s: the role_error event could not be sent", role)
        fatal = self.exhausted(role)
        if fatal is not None:
            fatal.__cause__ = exc
        elif isinstance(exc, EndsTheNode):
            return RoleFailed(role, [self.recent[-1]], 1, ended=exc)
        return fatal

    def succeeded(self, role: str) -> None:
        self._in_a_row.pop(role, None)

    def in_a_row(self, role: str) -> int:
        return len(self._in_a_row.get(role, ()))

    def exhausted(self, role: str) -> RoleFailed | None:
        """The error that ends the node, once ``role`` failed ``limit`` times in a row."""
        errors = self._in_a_row.get(role, [])
        if len(errors) < self.limit:
            return None
        return RoleFailed(role, errors[-self.limit :], self.limit)
