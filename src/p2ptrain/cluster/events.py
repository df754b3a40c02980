"""What a cluster member tells the program that runs it, as typed records.

``p2ptrain cluster --json`` writes each as one JSON object per line, its kind in the
``event`` field (``{"event": "step", "generation": 2, "step": 41, ...}``); without
``--json`` :func:`describe` words it for people.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "ClusterEvent",
    "GenerationFormed",
    "LeaderElected",
    "MemberFound",
    "MemberLost",
    "Refused",
    "Started",
    "Step",
    "Stopped",
    "describe",
    "encode_event",
]


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="event"):
    pass


class Started(_Event, tag="started", frozen=True):
    peer: str
    address: str
    cluster: str


class MemberFound(_Event, tag="member_found", frozen=True):
    """A member proved the secret to us (and we to it) for the first time."""

    peer: str
    address: str


class LeaderElected(_Event, tag="leader_elected", frozen=True):
    leader: str
    reason: str


class GenerationFormed(_Event, tag="generation_formed", frozen=True):
    generation: int
    world: int
    rank: int
    leader: str
    start_step: int
    members: tuple[str, ...]
    compression: str


class Step(_Event, tag="step", frozen=True):
    generation: int
    step: int
    loss: float
    seconds: float


class MemberLost(_Event, tag="member_lost", frozen=True):
    peer: str
    generation: int
    reason: str


class Refused(_Event, tag="refused", frozen=True):
    """A member whose proof of the secret failed (``fatal``: we give up and exit)."""

    address: str
    reason: str
    fatal: bool = False


class Stopped(_Event, tag="stopped", frozen=True):
    step: int
    reason: str


ClusterEvent = (
    Started | MemberFound | LeaderElected | GenerationFormed | Step | MemberLost | Refused | Stopped
)
_encoder = msgspec.json.Encoder()


def encode_event(event: ClusterEvent) -> str:
    return _encoder.encode(event).decode()


def describe(event: ClusterEvent) -> str:
    """One line for people."""
    match event:
        case Started():
            return f"member {event.peer[:12]} of cluster {event.cluster!r} at {event.address}"
        case MemberFound():
            return f"found member {event.peer[:12]} at {event.address}"
        case LeaderElected():
            return f"leader: {event.leader[:12]} ({event.reason})"
        case GenerationFormed():
            return (
                f"generation {event.generation}: rank {event.rank} of {event.world}, leader "
                f"{event.leader[:12]}, from step {event.start_step} ({event.compression})"
            )
        case Step():
            return f"step {event.step}: loss {event.loss:.4f} ({event.seconds * 1000:.0f} ms)"
        case MemberLost():
            return f"lost member {event.peer[:12]} of generation {event.generation}: {event.reason}"
        case Refused() if event.fatal:
            return f"giving up: {event.reason}"
        case Refused():
            return f"refused {event.address}: {event.reason}"
        case Stopped():
            return f"stopped after step {event.step}: {event.reason}"
