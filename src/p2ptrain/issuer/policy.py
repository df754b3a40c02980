"""Who the issuing service certifies, and how many keys each person may hold.

:class:`Policy` is the operator's rule: an allow-list of subjects and of groups
(organisations and teams), how many node keys one subject may hold certificates for at once
(Sybil control: a person cannot start a thousand trainers), the roles and lifetime of the
certificates, and whether a renewal needs a new sign-in. :class:`Ledger` remembers, in the
issuer's data directory, every key it certified, for whom, until when, and which keys were
revoked, so the limit holds across restarts and a revoked key is never renewed.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
from pathlib import Path
from typing import Final, Literal

from p2ptrain.core.admission import when_text
from p2ptrain.core.identity import peer_id_of
from p2ptrain.issuer.connectors import Proven

__all__ = ["LEDGER_FILE", "Ledger", "Policy"]

#: The issuer's ledger in its data directory.
LEDGER_FILE: Final = "issuer.sqlite"


@dataclasses.dataclass(frozen=True)
class Policy:
    #: How long a certificate is valid, seconds.
    lifetime_s: float = 30 * 86400
    #: The roles every certificate allows (empty: any).
    roles: tuple[str, ...] = ()
    #: How many keys one subject may hold unexpired certificates for at once.
    max_keys_per_subject: int = 2
    #: Subjects let in (``github:alice``, ``oidc:https://idp#1234``). With ``allow_groups``
    #: also empty, every subject a connector proves is let in.
    allow_subjects: frozenset[str] = frozenset()
    #: Organisations and teams let in (``org``, ``org/team``).
    allow_groups: frozenset[str] = frozenset()
    #: ``while-valid``: a node renews with its still-valid certificate alone; ``sign-in``:
    #: every certificate needs a new sign-in.
    renew: Literal["while-valid", "sign-in"] = "while-valid"

    def refusal(self, proven: Proven) -> str | None:
        """Why ``proven`` is not let in (None: it is)."""
        if not self.allow_subjects and not self.allow_groups:
            return None
        if proven.subject in self.allow_subjects or proven.groups & self.allow_groups:
            return None
        allowed = sorted(self.allow_subjects) + sorted(self.allow_groups)
        shown = ", ".join(allowed[:5]) + (
            f" and {len(allowed) - 5} more" if len(allowed) > 5 else ""
        )
        groups = f" (member of {', '.join(sorted(proven.groups))})" if proven.groups else ""
        return (
            f"{proven.subject}{groups} is not on this network's allow-list ({shown}); ask "
            "the network's operator to add you"
        )

    def renewal_refusal(self, subject: str) -> str | None:
        """Why a certificate of ``subject`` is not renewed without a sign-in (None: it is).
        Group membership is only known at a sign-in: where the allow-list names groups, an
        operator who wants it checked again at each renewal sets ``renew = "sign-in"``."""
        if not self.allow_subjects or subject in self.allow_subjects or self.allow_groups:
            return None
        return f"{subject} is no longer on this network's allow-list"


class Ledger:
    """Every key the issuer certified (sqlite in its data directory; thread-safe)."""

    def __init__(self, directory: Path) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(directory / LEDGER_FILE, check_same_thread=False)
        with self._db:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS certified (key BLOB PRIMARY KEY, subject TEXT "
                "NOT NULL, not_after_ms INTEGER NOT NULL, issued_at_ms INTEGER NOT NULL, "
                "revoked INTEGER NOT NULL DEFAULT 0)"
            )
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS redeemed (invite TEXT NOT NULL, key BLOB NOT NULL, "
                "PRIMARY KEY (invite, key))"
            )

    def close(self) -> None:
        self._db.close()

    def limit_problem(self, key: bytes, subject: str, limit: int, at_ms: int) -> str | None:
        """Why ``subject`` may not hold a certificate for ``key`` now (None: it may)."""
        with self._lock:
            row = self._db.execute(
                "SELECT subject, revoked FROM certified WHERE key = ?", (key,)
            ).fetchone()
            if row is not None and row[1]:
                return f"key {peer_id_of(key)[:16]} was revoked; sign in with a new key"
            if row is not None and row[0] != subject:
                return (
                    f"key {peer_id_of(key)[:16]} is certified for another person; sign in "
                    "with a key of your own (p2ptrain init --dir NEW_DIR)"
                )
            held = self._db.execute(
                "SELECT key, not_after_ms FROM certified WHERE subject = ? AND key != ? AND "
                "revoked = 0 AND not_after_ms > ? ORDER BY not_after_ms",
                (subject, key, at_ms),
            ).fetchall()
        if len(held) < limit:
            return None
        held_text = (
            "a certificate for 1 node key"
            if len(held) == 1
            else (f"certificates for {len(held)} node keys")
        )
        return (
            f"{subject} already holds {held_text}, the most this network allows one person; "
            f"the first expires at {when_text(held[0][1])} "
            "(an issuer can revoke one sooner: p2ptrain revoke KEY)"
        )

    def record(self, key: bytes, subject: str, not_after_ms: int, issued_at_ms: int) -> None:
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO certified (key, subject, not_after_ms, issued_at_ms) VALUES "
                "(?, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET not_after_ms = excluded."
                "not_after_ms, issued_at_ms = excluded.issued_at_ms",
                (key, subject, not_after_ms, issued_at_ms),
            )

    def revoke(self, key: bytes) -> None:
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO certified (key, subject, not_after_ms, issued_at_ms, revoked) "
                "VALUES (?, '', 0, 0, 1) ON CONFLICT (key) DO UPDATE SET revoked = 1",
                (key,),
            )

    def redeem(self, invite: str, key: bytes, uses: int) -> str | None:
        """Count ``key`` as a use of ``invite`` (None), or say why not: all its ``uses``
        went to other keys. The same key redeeming again is no new use."""
        with self._lock, self._db:
            keys = {
                bytes(row[0])
                for row in self._db.execute("SELECT key FROM redeemed WHERE invite = ?", (invite,))
            }
            if key in keys:
                return None
            if len(keys) >= uses:
                return (
                    f"this invite was used up: it admits {uses} key{'s' if uses != 1 else ''}, "
                    "and all were admitted; ask for a new invite"
                )
            self._db.execute("INSERT INTO redeemed (invite, key) VALUES (?, ?)", (invite, key))
        return None

    def subject_of(self, key: bytes) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT subject FROM certified WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])
