"""Protocol records (DESIGN §3): peers, updates, proposals, heads, attestations, metrics.

Every record is a frozen msgspec Struct that validates itself on construction and on decode.
Sequences that are sets (accepted update ids, roles, ...) are stored sorted, so one set has
one encoding and one id.
"""

from __future__ import annotations

import msgspec

from p2ptrain.core import field_rules as rules
from p2ptrain.core.encoding import record_id
from p2ptrain.core.identity import peer_id_of
from p2ptrain.core.reasons import Reason, describe
from p2ptrain.core.roles import ROLES
from p2ptrain.errors import InvalidRecord

REACHABILITY = ("public", "relayed", "outbound")

MAX_ADDRESSES = 16
MAX_UPDATES_PER_WINDOW = 1_000_000
MAX_LEASE_SHARDS = 4096
MAX_QUARANTINE_ENTRIES = 100_000
#: Bounds of a metrics report's numbers: a loss beyond these is a broken evaluation.
MAX_REPORTED_LOSS = 1e9
MAX_REPORTED_PERPLEXITY = 1e300
MAX_REPORTED_SAMPLES = 1 << 40
MAX_SUBJECT_NAME_CHARS = 256
MAX_REVOCATION_REASON_CHARS = 256


class PeerRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to reach a peer and what it does. Signed by the peer; a higher ``seq`` replaces."""

    network_id: str
    public_key: bytes
    seq: int
    roles: tuple[str, ...]
    reachability: str
    addresses: tuple[str, ...] = ()
    relay: str | None = None
    tls_fingerprint: str | None = None
    issued_at_ms: int = 0

    def __post_init__(self) -> None:
        rules.check_hex_id("network_id", self.network_id)
        rules.check_public_key("public_key", self.public_key)
        rules.check_int("seq", self.seq, 0)
        rules.check_count("roles", self.roles, 1, len(ROLES))
        rules.check_sorted_unique("roles", self.roles)
        for role in self.roles:
            rules.check_choice("roles", role, ROLES)
        rules.check_choice("reachability", self.reachability, REACHABILITY)
        rules.check_count("addresses", self.addresses, 0, MAX_ADDRESSES)
        for i, address in enumerate(self.addresses):
            rules.check_address(f"addresses[{i}]", address)
        if self.reachability == "public" and not self.addresses:
            raise InvalidRecord("addresses", "a 'public' peer must list at least one address")
        if (self.reachability == "relayed") != (self.relay is not None):
            raise InvalidRecord("relay", "a relay address is given exactly when 'relayed'")
        if self.relay is not None:
            rules.check_address("relay", self.relay)
        rules.check_optional_hex_id("tls_fingerprint", self.tls_fingerprint)
        rules.check_int("issued_at_ms", self.issued_at_ms, 0)

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.public_key)


class Update(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A trainer's pseudo-gradient for one window, by reference to its blob."""

    experiment_id: str
    window: int
    base_head: str
    trainer: bytes
    lease_shards: tuple[str, ...]
    lease_samples: int
    delta_blob: str
    delta_bytes: int
    codec: str
    loss_before: float
    loss_after: float

    def __post_init__(self) -> None:
        rules.check_hex_id("experiment_id", self.experiment_id)
        rules.check_int("window", self.window, 1)
        rules.check_hex_id("base_head", self.base_head)
        rules.check_public_key("trainer", self.trainer)
        rules.check_count("lease_shards", self.lease_shards, 1, MAX_LEASE_SHARDS)
        rules.check_sorted_unique("lease_shards", self.lease_shards)
        for shard in self.lease_shards:
            rules.check_name("lease_shards", shard)
        rules.check_int("lease_samples", self.lease_samples, 1)
        rules.check_hex_id("delta_blob", self.delta_blob)
        rules.check_int("delta_bytes", self.delta_bytes, 1)
        rules.check_name("codec", self.codec)
        rules.check_float("loss_before", self.loss_before, -1e30, 1e30)
        rules.check_float("loss_after", self.loss_after, -1e30, 1e30)

    @property
    def id(self) -> str:
        return record_id(self)

    @property
    def trainer_id(self) -> str:
        return peer_id_of(self.trainer)


class QuarantineEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A trainer's standing after a head: excluded from windows up to and including
    ``until_window`` (0: not excluded), ``strikes`` rejected updates in a row since its last
    accepted one or its last quarantine, ``offences`` quarantines so far (repeat offenders
    stay out longer). A trainer with none of these has no entry."""

    peer_id: str
    until_window: int
    #: The rejection behind the standing: the first of the strikes, or the one that made
    #: the trainer an offender (:meth:`describe` says it in words).
    reason: Reason
    strikes: int = 0
    offences: int = 0

    def __post_init__(self) -> None:
        rules.check_hex_id("quarantine.peer_id", self.peer_id)
        rules.check_int("quarantine.until_window", self.until_window, 0)
        rules.check_int("quarantine.strikes", self.strikes, 0, 1_000_000)
        rules.check_int("quarantine.offences", self.offences, 0, 1_000_000)
        if self.until_window == 0 and self.strikes == 0 and self.offences == 0:
            raise InvalidRecord("quarantine", "an entry with no strikes, offences or exclusion")

    def describe(self) -> str:
        """The standing's reason in words."""
        if self.offences:
            return f"quarantined for rejected updates in a row (last: {describe(self.reason)})"
        return describe(self.reason)


class Head(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One point of the model's history. Its id binds parent, updates, weights and the
    aggregate that stepped the parent's weights to these (``aggregate_blob``, None only at
    genesis): a follower holding the parent's state needs only the aggregate."""

    experiment_id: str
    height: int
    parent: str | None
    weights_blob: str
    optimizer_blob: str | None
    accepted: tuple[str, ...] = ()
    quarantine: tuple[QuarantineEntry, ...] = ()
    aggregate_blob: str | None = None

    def __post_init__(self) -> None:
        rules.check_hex_id("experiment_id", self.experiment_id)
        rules.check_int("height", self.height, 0)
        rules.check_optional_hex_id("parent", self.parent)
        if (self.height == 0) != (self.parent is None):
            raise InvalidRecord("parent", "only the genesis head (height 0) has no parent")
        rules.check_hex_id("weights_blob", self.weights_blob)
        rules.check_optional_hex_id("optimizer_blob", self.optimizer_blob)
        rules.check_optional_hex_id("aggregate_blob", self.aggregate_blob)
        if (self.height == 0) != (self.aggregate_blob is None):
            raise InvalidRecord("aggregate_blob", "every head but the genesis names its aggregate")
        rules.check_count("accepted", self.accepted, 0, MAX_UPDATES_PER_WINDOW)
        if self.height == 0 and self.accepted:
            raise InvalidRecord("accepted", "the genesis head accepts no updates")
        rules.check_sorted_unique("accepted", self.accepted)
        for update_id in self.accepted:
            rules.check_hex_id("accepted", update_id)
        rules.check_count("quarantine", self.quarantine, 0, MAX_QUARANTINE_ENTRIES)
        rules.check_sorted_unique("quarantine", [q.peer_id for q in self.quarantine])

    @property
    def id(self) -> str:
        return record_id(self)


class Rejection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An update left out of a proposal, and why."""

    update_id: str
    reason: Reason

    def __post_init__(self) -> None:
        rules.check_hex_id("rejected.update_id", self.update_id)

    def describe(self) -> str:
        """Why, in words."""
        return describe(self.reason)


class Proposal(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A reducer's (or falling-back validator's) candidate next head for a window."""

    experiment_id: str
    window: int
    base_head: str
    reducer: bytes
    accepted: tuple[str, ...]
    rejected: tuple[Rejection, ...]
    aggregate_blob: str
    head: Head

    def __post_init__(self) -> None:
        rules.check_hex_id("experiment_id", self.experiment_id)
        rules.check_int("window", self.window, 1)
        rules.check_hex_id("base_head", self.base_head)
        rules.check_public_key("reducer", self.reducer)
        rules.check_sorted_unique("rejected", [r.update_id for r in self.rejected])
        if set(self.accepted) & {r.update_id for r in self.rejected}:
            raise InvalidRecord("rejected", "an update cannot be both accepted and rejected")
        rules.check_hex_id("aggregate_blob", self.aggregate_blob)
        head = self.head
        if head.experiment_id != self.experiment_id:
            raise InvalidRecord("head.experiment_id", "differs from the proposal's experiment")
        if head.height != self.window or head.parent != self.base_head:
            raise InvalidRecord("head", "must have height = window and parent = base_head")
        if head.accepted != self.accepted:
            raise InvalidRecord("head.accepted", "must equal the proposal's accepted updates")
        if head.aggregate_blob != self.aggregate_blob:
            raise InvalidRecord("head.aggregate_blob", "must equal the proposal's aggregate")

    @property
    def id(self) -> str:
        return record_id(self)


#: A validator's two votes in a round of a height: it *prevotes* the head it judged (or the
#: one it is locked on), and *commits* a head once q validators prevoted it in that round; q
#: commits of one round are a certificate (DESIGN §4 step 7, docs/protocol.md §6).
VOTE_STAGES = ("prevote", "commit")
#: The highest voting round a height may reach (rounds last a pass of the proposers' slots).
MAX_ROUND = 1 << 20


class Attestation(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A validator's vote for a head at a height, in one round and stage: it computed exactly
    this head (``prevote``), or it saw q prevotes for it in this round (``commit``)."""

    experiment_id: str
    height: int
    head_id: str
    validator: bytes
    round: int
    stage: str

    def __post_init__(self) -> None:
        rules.check_hex_id("experiment_id", self.experiment_id)
        rules.check_int("height", self.height, 1)
        rules.check_hex_id("head_id", self.head_id)
        rules.check_public_key("validator", self.validator)
        rules.check_int("round", self.round, 0, MAX_ROUND)
        rules.check_choice("stage", self.stage, VOTE_STAGES)


class AdmissionCertificate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An issuer's permission for one peer key to join a ``certificate`` network.

    Signed by ``issuer``, which must be one of the network manifest's ``issuer_keys``.
    ``not_after_ms`` is the expiry in Unix milliseconds (0: does not expire). ``roles``: the
    roles the peer may announce (empty: any). ``name``: who the issuer checked the key
    belongs to (``github:login``, ``oidc:issuer#sub``; empty: not said).
    """

    network_id: str
    subject: bytes
    issuer: bytes
    not_after_ms: int = 0
    roles: tuple[str, ...] = ()
    issued_at_ms: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        rules.check_hex_id("network_id", self.network_id)
        rules.check_public_key("subject", self.subject)
        rules.check_public_key("issuer", self.issuer)
        rules.check_int("not_after_ms", self.not_after_ms, 0)
        rules.check_count("roles", self.roles, 0, len(ROLES))
        rules.check_sorted_unique("roles", self.roles)
        for role in self.roles:
            rules.check_choice("roles", role, ROLES)
        rules.check_int("issued_at_ms", self.issued_at_ms, 0)
        rules.check_text("name", self.name, MAX_SUBJECT_NAME_CHARS)

    def allows(self, roles: tuple[str, ...]) -> bool:
        """Whether a peer holding this certificate may announce ``roles``."""
        return not self.roles or set(roles) <= set(self.roles)


class Revocation(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An issuer withdraws a peer key's admission to a ``certificate`` network for good.

    Signed by ``issuer`` (one of the network's ``issuer_keys``, or its authority). Every node
    that hears it closes the peer's connections, refuses its requests and the records it
    signed, keeps the revocation, and passes it to each peer it connects to.
    """

    network_id: str
    subject: bytes
    issuer: bytes
    issued_at_ms: int
    reason: str = ""

    def __post_init__(self) -> None:
        rules.check_hex_id("network_id", self.network_id)
        rules.check_public_key("subject", self.subject)
        rules.check_public_key("issuer", self.issuer)
        rules.check_int("issued_at_ms", self.issued_at_ms, 0)
        rules.check_text("reason", self.reason, MAX_REVOCATION_REASON_CHARS)


class MetricsReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An evaluator's validation result for one certified head.

    Signed by ``evaluator``. An evaluation is not bit-reproducible, so a report never enters
    a head id: it travels beside the chain. ``loss`` is the mean validation loss,
    ``perplexity`` its exponential for a language model (None otherwise), ``samples`` the
    number of validation samples evaluated (0: the workload does not say).
    """

    experiment_id: str
    height: int
    head_id: str
    evaluator: bytes
    loss: float
    perplexity: float | None
    samples: int

    def __post_init__(self) -> None:
        rules.check_hex_id("experiment_id", self.experiment_id)
        rules.check_int("height", self.height, 0)
        rules.check_hex_id("head_id", self.head_id)
        rules.check_public_key("evaluator", self.evaluator)
        rules.check_float("loss", self.loss, -MAX_REPORTED_LOSS, MAX_REPORTED_LOSS)
        if self.perplexity is not None:
            rules.check_float("perplexity", self.perplexity, 0.0, MAX_REPORTED_PERPLEXITY)
        rules.check_int("samples", self.samples, 0, MAX_REPORTED_SAMPLES)

    @property
    def id(self) -> str:
        return record_id(self)

    @property
    def evaluator_id(self) -> str:
        return peer_id_of(self.evaluator)
