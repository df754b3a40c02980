"""A validator's votes at one height, round after round (DESIGN §4 steps 6-7).

Validators vote in rounds, as Tendermint does, so that a split vote is not final: in a round a
validator *prevotes* one head (the one it judged first in slot order, or the one it is locked
on); once q validators prevoted one head in that round it *commits* that head and locks on it;
q commits of one round are the certificate. When a round ends without a certificate (each pass
of the proposers' slots is a round, and a validator follows others into a later round once
more than ``n - q`` of them reached it), the next round starts: a validator prevotes its lock,
or, unlocked, the earliest valid proposal it holds. So two honest validators that prevoted
different heads (one proposal reached one of them late) agree in the next round.

Safety needs no clock: a validator votes once per round and stage, commits only a head that
q validators prevoted in its current round, and once locked prevotes another head only after q
validators prevoted that one in a round after its lock. If q commits of round r certified H,
at least q - f honest validators are locked on H, and any later quorum of prevotes holds one of
them, so no other head gathers q prevotes (nor commits) in a later round (f < 2q - n, the same
bound as one vote per height).

:class:`Ballot` is what a validator persists per height before each vote goes out; after a
restart it votes from the next round on (it may have voted in the stored one), keeping its lock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from p2ptrain.errors import LocalError

__all__ = ["Ballot"]


@dataclass
class Ballot:
    """What a validator voted at one height: the round it is in, its prevote and commit there
    (None: not yet), and the head it is locked on with the round it committed it in."""

    round: int = 0
    prevote: str | None = None
    commit: str | None = None
    lock: str | None = None
    lock_round: int = -1

    def enter(self, round_: int) -> bool:
        """Move on to ``round_`` (False, unchanged: it is not after the current round)."""
        if round_ <= self.round:
            return False
        self.round, self.prevote, self.commit = round_, None, None
        return True

    def after_restart(self) -> Ballot:
        """The ballot to resume with after a crash: the next round (votes of the stored one
        may have gone out), the same lock."""
        return Ballot(round=self.round + 1, lock=self.lock, lock_round=self.lock_round)

    @property
    def head(self) -> str | None:
        """The head this ballot stands for, for people: the lock, else this round's prevote."""
        return self.lock if self.lock is not None else self.prevote

    def to_json(self) -> str:
        return json.dumps(
            {
                "round": self.round,
                "prevote": self.prevote,
                "commit": self.commit,
                "lock": self.lock,
                "lock_round": self.lock_round,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, where: str) -> Ballot:
        """A stored ballot (``where``: what held it, for the error)."""
        try:
            raw = json.loads(text)
            ballot = cls(
                round=int(raw["round"]),
                prevote=_optional_text(raw["prevote"]),
                commit=_optional_text(raw["commit"]),
                lock=_optional_text(raw["lock"]),
                lock_round=int(raw["lock_round"]),
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise LocalError(
                f"{where}: a stored vote is not readable ({exc}); the data directory was written "
                f"by another p2ptrain or damaged: start this validator on a new data directory"
            ) from exc
        return ballot


def _optional_text(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"expected a head id or null, got {value!r}")
