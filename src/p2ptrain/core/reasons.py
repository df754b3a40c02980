"""Why an update was turned down, as reducers and validators must agree on it: a code and
typed arguments, never English (protocol 5).

A proposal names each update it rejects with a :class:`Reason`, and a head's quarantine book
keeps the reason of each trainer's standing; a validator recomputes the cohort and compares
the reasons it finds with the proposal's. Comparing words would fork the network on a
rewording or a translation, so what is signed, hashed and compared is the code and its
arguments (integers, floats as the bit-exact arithmetic computed them, and names). The
human text (:func:`describe`) is derived from them, for logs, the status and the
dashboard, from :data:`TEXTS`; rewording it changes no record.
"""

from __future__ import annotations

import math
from enum import IntEnum

import msgspec

from p2ptrain.core import field_rules as rules
from p2ptrain.errors import InvalidRecord

__all__ = ["ARGS", "ARITY", "TEXTS", "Code", "Reason", "describe"]

#: Each text argument is a name (a codec, a parameter): at most this many characters.
MAX_ARG_CHARS = 64

Arg = int | float | str


class Code(IntEnum):
    """Every reason an update is rejected for. The numbers are part of the protocol: a new
    reason takes a new number, a retired one is never reused."""

    #: (until_window,) its trainer is excluded through that window; not a strike
    QUARANTINED = 1
    #: () its trainer sent another update in the same window
    REPEATED = 2
    #: (codec, expected) encoded with another codec than the experiment's
    WRONG_CODEC = 3
    #: (window,) names other shards than its trainer's lease of the window
    LEASE_SHARDS = 4
    #: (claimed, expected) claims another sample count than the lease holds
    LEASE_SAMPLES = 5
    #: () its blob does not have the hash and size the update names
    BLOB_MISMATCH = 6
    #: () its blob does not decode with the experiment's codec and the model's schema
    UNDECODABLE = 7
    #: () its tensors are not the model's parameters
    SCHEMA_MISMATCH = 8
    #: (parameter,) a tensor that is not float32
    NOT_FLOAT32 = 9
    #: (parameter,) a tensor of another shape than the parameter's
    WRONG_SHAPE = 10
    #: (parameter,) a tensor with NaN or infinite values
    NOT_FINITE = 11
    #: (ratio, max_ratio) its norm over the cohort's median norm is above the limit
    NORM_ABOVE = 12
    #: (ratio, max_ratio) its norm over the cohort's median norm is below 1/limit
    NORM_BELOW = 13
    #: (cosine, min_cosine) its cosine to the cohort's robust centre is below the limit
    COSINE_BELOW = 14


#: How each code reads (``str.format`` of its arguments, in order).
TEXTS: dict[Code, str] = {
    Code.QUARANTINED: "trainer is quarantined until window {0}",
    Code.REPEATED: "trainer sent more than one update in this window",
    Code.WRONG_CODEC: "codec {0!r}, the experiment uses {1!r} in this window",
    Code.LEASE_SHARDS: "lease names other shards than the trainer's lease for window {0}",
    Code.LEASE_SAMPLES: "lease claims {0} samples, the lease holds {1}",
    Code.BLOB_MISMATCH: "blob does not match the update's delta_blob hash and size",
    Code.UNDECODABLE: "undecodable update: not the experiment's codec and model schema",
    Code.SCHEMA_MISMATCH: "tensors do not match the model schema",
    Code.NOT_FLOAT32: "parameter {0!r} is not float32",
    Code.WRONG_SHAPE: "parameter {0!r} does not have the model's shape",
    Code.NOT_FINITE: "parameter {0!r} holds NaN or infinite values",
    Code.NORM_ABOVE: "norm {0:.2f}x the cohort median exceeds {1}x",
    Code.NORM_BELOW: "norm {0:.3f}x the cohort median is below 1/{1} (no training?)",
    Code.COSINE_BELOW: "cosine {0:.3f} to the cohort's robust centre is below {1}",
}

#: The arguments each code takes, by name, in order.
ARGS: dict[Code, tuple[str, ...]] = {
    Code.QUARANTINED: ("until_window",),
    Code.REPEATED: (),
    Code.WRONG_CODEC: ("codec", "expected"),
    Code.LEASE_SHARDS: ("window",),
    Code.LEASE_SAMPLES: ("claimed", "expected"),
    Code.BLOB_MISMATCH: (),
    Code.UNDECODABLE: (),
    Code.SCHEMA_MISMATCH: (),
    Code.NOT_FLOAT32: ("parameter",),
    Code.WRONG_SHAPE: ("parameter",),
    Code.NOT_FINITE: ("parameter",),
    Code.NORM_ABOVE: ("ratio", "max_ratio"),
    Code.NORM_BELOW: ("ratio", "max_ratio"),
    Code.COSINE_BELOW: ("cosine", "min_cosine"),
}
#: How many arguments each code takes.
ARITY: dict[Code, int] = {code: len(names) for code, names in ARGS.items()}


class Reason(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A code of :class:`Code` and its arguments."""

    code: int
    args: tuple[Arg, ...] = ()

    def __post_init__(self) -> None:
        try:
            code = Code(self.code)
        except ValueError:
            raise InvalidRecord("reason.code", f"{self.code} is not a known reason") from None
        if len(self.args) != ARITY[code]:
            raise InvalidRecord(
                "reason.args", f"{code.name} takes {ARITY[code]} arguments, got {len(self.args)}"
            )
        for arg in self.args:
            if isinstance(arg, str):
                rules.check_text("reason.args", arg, MAX_ARG_CHARS)
            elif isinstance(arg, float) and not math.isfinite(arg):
                raise InvalidRecord("reason.args", "must be finite numbers")

    def __str__(self) -> str:
        return describe(self)


def describe(reason: Reason) -> str:
    """The reason in words (never compared or hashed)."""
    return TEXTS[Code(reason.code)].format(*reason.args)
