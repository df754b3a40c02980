"""Who proposes a window's head, and when (DESIGN §4 step 6).

After a window's update deadline, proposers get consecutive slots of
``window.proposal_s`` seconds each: first the reducers ranked by rendezvous hash of
(experiment, window, key), then the manifest's validators ranked the same way (the fallback:
a validator proposes its own reduction when every reducer before it was silent, late or
wrong). A validator attests the first valid proposal from the proposer whose slot is open or
has passed; it skips ahead as soon as a proposer is caught proposing a wrong head.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

from p2ptrain.core.manifests import ExperimentManifest

__all__ = ["proposer_order", "slot_at", "slot_start"]

_DOMAIN = b"p2ptrain/v1/proposer"


def _rank(experiment_id: str, window: int, keys: Iterable[bytes]) -> list[bytes]:
    def score(key: bytes) -> bytes:
        return hashlib.sha256(
            b"\0".join([_DOMAIN, experiment_id.encode(), str(window).encode(), key])
        ).digest()

    return sorted(set(keys), key=score)


def proposer_order(
    manifest: ExperimentManifest,
    experiment_id: str,
    window: int,
    reducers: Iterable[bytes],
    dropped: Iterable[bytes] = (),
) -> tuple[bytes, ...]:
    """The proposers of ``window`` in slot order: ranked reducers (without those
    ``dropped`` for proposing wrong heads, and without validators), then ranked validators."""
    validators = set(manifest.validators)
    skip = set(dropped)
    pool = [key for key in reducers if key not in skip and key not in validators]
    return tuple(_rank(experiment_id, window, pool) + _rank(experiment_id, window, validators))


def slot_start(manifest: ExperimentManifest, closed_at: float, index: int) -> float:
    """When slot ``index`` opens for a window that closed (its deadline, or an early close)
    at ``closed_at``."""
    return closed_at + index * manifest.window.proposal_s


def slot_at(manifest: ExperimentManifest, closed_at: float, now: float) -> int:
    """The slot open at ``now`` for a window that closed at ``closed_at`` (-1 before it
    closed); slots go on past the last proposer (the order starts over)."""
    # + 1e-9 s: a time computed as a slot boundary opens that slot despite rounding
    elapsed = now - closed_at + 1e-9
    return -1 if elapsed < 0 else math.floor(elapsed / manifest.window.proposal_s)
