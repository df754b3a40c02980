"""Network and experiment manifests (DESIGN §3).

A manifest is immutable once signed: its id (the SHA-256 of its canonical encoding) names it.
Each Struct validates itself on construction and on decode; a bad field raises
:class:`~p2ptrain.errors.InvalidRecord` naming the field.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import math

import msgspec

from p2ptrain.core import field_rules as rules
from p2ptrain.core.encoding import record_id
from p2ptrain.errors import InvalidRecord

PROTOCOL_VERSION = 8
#: What each protocol version changed (said when a peer or a data directory speaks another).
VERSION_CHANGES = {
    2: "leases changed",
    3: "heads name their aggregate",
    4: "inner learning-rate schedules, rounded aggregates, int4 and int2 codecs",
    5: "rejection and quarantine reasons are codes, not English",
    6: "validators vote in rounds (prevote, then commit); certificates name their round",
    7: (
        "gossip passes ids on (have, want) and sends each body once; nodes say what they "
        "skip; a sparse codec's warm-up aggregates are int4"
    ),
    8: "a rounded (int8, int4, int2) aggregate is stored sparse when that is smaller",
}

ADMISSION_POLICIES = ("open", "certificate")
TRAINING_PROTOCOLS = ("diloco", "fedavg")
OUTER_OPTIMIZERS = ("nesterov", "sgd")
INNER_OPTIMIZERS = ("adamw", "adam", "sgd")
#: How the inner learning rate changes from window to window (``InnerOptimizerSpec``).
INNER_SCHEDULES = ("constant", "cosine")
#: How trainers get a lease's samples (docs/data.md): ``indexed`` -- from a map-style dataset
#: every trainer holds; ``sharded`` -- from prepared shard files fetched from peers by hash;
#: ``generated`` -- made from the lease, no data moves; ``custom`` -- a user callback.
DATA_KINDS = ("indexed", "sharded", "generated", "custom")
UPDATE_CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "int2", "topk", "lowrank", "sparseloco")
AGGREGATION_RULES = (
    "mean",
    "trimmed_mean",
    "median",
    "krum",
    "centered_clip",
    "geometric_median",
    "contributor_mean",
)

#: How a window's aggregate is rounded before the outer step and stored for followers:
#: ``fp32`` -- not at all; ``bf16`` -- to bfloat16 (half the bytes; a sparse aggregate stays
#: sparse); ``int8`` / ``int4`` / ``int2`` -- blockwise, as the update codecs of those names
#: quantise (a quarter, an eighth, a sixteenth of the bytes to download; a sparse aggregate
#: stays sparse, only its stored values rounded).
AGGREGATE_PRECISIONS = ("fp32", "bf16", "int8", "int4", "int2")

MAX_CONFIG_ENTRIES = 64
MAX_STALENESS = 4
MAX_VALIDATORS = 256
MAX_SHARDS = 100_000
#: The largest shard file of a ``sharded`` dataset (a shard is fetched whole).
MAX_SHARD_BYTES = 1 << 30

ConfigValue = str | int | float | bool
Config = dict[str, ConfigValue]

_SECRET_CHECK_LABEL = b"p2ptrain/v1/network-secret-check"


def check_config(field: str, config: Config) -> None:
    """Free-form component settings: bounded, named keys, finite numbers, short strings."""
    if len(config) > MAX_CONFIG_ENTRIES:
        raise InvalidRecord(field, f"has {len(config)} entries; the limit is {MAX_CONFIG_ENTRIES}")
    for key, value in config.items():
        rules.check_name(f"{field}.{key}", key)
        if isinstance(value, float):
            rules.check_float(f"{field}.{key}", value, -1e300, 1e300)
        elif isinstance(value, str):
            rules.check_text(f"{field}.{key}", value, 256)


def secret_check(secret: bytes) -> bytes:
    """What a manifest publishes about its network secret: an HMAC that never reveals it."""
    return hmac.new(secret, _SECRET_CHECK_LABEL, hashlib.sha256).digest()


def minority_quorum_problem(quorum: int, validators: int, opt_in: str) -> str | None:
    """Why a quorum of ``quorum`` out of ``validators`` is unsafe, and what to do (None:
    it is a majority). ``opt_in`` names how the operator accepts the risk (a flag, an
    argument)."""
    if 2 * quorum > validators:
        return None
    return (
        f"quorum {quorum} of {validators} validators is not a majority: two disjoint groups "
        f"of {quorum} validators could each certify a different head at the same height (a "
        "fork no rule can settle), and a minority of the validators can certify a head the "
        f"others never checked. Raise quorum to at least {validators // 2 + 1}, or, to accept "
        f"that risk (a test network, validators you run yourself), pass {opt_in}"
    )


class NetworkManifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One p2ptrain network: who may join and where to start. Signed by ``authority``."""

    name: str
    authority: bytes
    protocol_version: int = PROTOCOL_VERSION
    bootstrap: tuple[str, ...] = ()
    admission: str = "open"
    issuer_keys: tuple[bytes, ...] = ()
    #: ``secret_check(secret)`` for a private network, else None. The secret itself travels
    #: out of band; peers prove they know it by challenge-response, never in clear.
    secret_check: bytes | None = None

    def __post_init__(self) -> None:
        rules.check_name("name", self.name)
        rules.check_public_key("authority", self.authority)
        if self.protocol_version != PROTOCOL_VERSION:
            raise InvalidRecord(
                "protocol_version",
                f"is {self.protocol_version}; this p2ptrain speaks protocol {PROTOCOL_VERSION} "
                f"only ({VERSION_CHANGES.get(PROTOCOL_VERSION, 'records changed')}): run the "
                f"p2ptrain release of protocol {self.protocol_version} to take part in that "
                "network, or start a new network and experiment with this one",
            )
        rules.check_count("bootstrap", self.bootstrap, 0, 64)
        for i, address in enumerate(self.bootstrap):
            rules.check_address(f"bootstrap[{i}]", address)
        rules.check_choice("admission", self.admission, ADMISSION_POLICIES)
        rules.check_count("issuer_keys", self.issuer_keys, 0, 64)
        rules.check_sorted_unique("issuer_keys", self.issuer_keys)
        for i, key in enumerate(self.issuer_keys):
            rules.check_public_key(f"issuer_keys[{i}]", key)
        if self.admission == "certificate" and not self.issuer_keys:
            raise InvalidRecord("issuer_keys", "a 'certificate' network needs at least one issuer")
        if self.admission == "open" and self.issuer_keys:
            raise InvalidRecord("issuer_keys", "an 'open' network takes no issuer keys")
        if self.secret_check is not None and len(self.secret_check) != 32:
            raise InvalidRecord("secret_check", "must be 32 bytes (see secret_check())")

    @property
    def id(self) -> str:
        return record_id(self)

    def accepts_secret(self, secret: bytes) -> bool:
        """True when ``secret`` is this private network's secret."""
        return self.secret_check is not None and hmac.compare_digest(
            self.secret_check, secret_check(secret)
        )


class WorkloadSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What is trained: a workload name, its settings and the model schema hash.

    ``reference`` is the code a workload given by reference came from, as its author named
    it (``path/to/file.py:factory``, ``package.module:factory``; empty for built-in and
    installed workloads): a hint for operators, who pass the same code with ``--workload``.
    ``config_hash`` hashes the config and the model's own configuration (a Hugging Face
    ``config``), so that a node whose model is configured differently can say so."""

    name: str
    schema_hash: str
    config: Config = {}
    reference: str = ""
    config_hash: str = ""
    #: Samples per inner step (0: not recorded); a trainer must use the same.
    batch_size: int = 0

    def __post_init__(self) -> None:
        rules.check_name("workload.name", self.name)
        rules.check_hex_id("workload.schema_hash", self.schema_hash)
        check_config("workload.config", self.config)
        rules.check_text("workload.reference", self.reference, 256)
        if self.config_hash:
            rules.check_hex_id("workload.config_hash", self.config_hash)
        rules.check_int("workload.batch_size", self.batch_size, 0, 1 << 24)


class ShardInfo(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One data shard: a name, its content hash and its sample count. For a ``sharded``
    dataset ``blob_id`` is the blob holding the shard file and ``bytes`` its size; for the
    other kinds ``blob_id`` hashes the shard's samples (or what generates them) and ``bytes``
    is 0."""

    name: str
    blob_id: str
    samples: int
    bytes: int = 0

    def __post_init__(self) -> None:
        rules.check_name("dataset.shards.name", self.name)
        rules.check_hex_id("dataset.shards.blob_id", self.blob_id)
        rules.check_int("dataset.shards.samples", self.samples, 1)
        rules.check_int("dataset.shards.bytes", self.bytes, 0, MAX_SHARD_BYTES)


#: How a text dataset's token ids were made (``p2ptrain data prepare --tokenizer``).
TOKENIZER_KINDS = ("bytes", "chars", "huggingface")
#: The largest vocabulary a dataset may record (token ids are below it).
MAX_VOCAB_SIZE = 1 << 24
#: The most characters a ``chars`` vocabulary may hold (Unicode has fewer code points).
MAX_CHARS_VOCAB = 1_114_112


class TokenizerSpec(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """How a text dataset's rows of token ids were made, so that every peer builds a model
    of the right vocabulary and an export can decode ids: ``kind`` ``bytes`` (UTF-8 bytes,
    256 ids), ``chars`` (``vocab`` holds the character of each id, in id order: the sorted
    distinct characters of the corpus) or ``huggingface`` (a tokenizer of class ``name``);
    ``vocab_size`` ids, ``block_size`` tokens per row."""

    kind: str
    vocab_size: int
    block_size: int
    vocab: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        rules.check_choice("dataset.tokenizer.kind", self.kind, TOKENIZER_KINDS)
        rules.check_int("dataset.tokenizer.vocab_size", self.vocab_size, 1, MAX_VOCAB_SIZE)
        rules.check_int("dataset.tokenizer.block_size", self.block_size, 1, 1 << 24)
        if self.kind == "bytes" and self.vocab_size != 256:
            raise InvalidRecord("dataset.tokenizer.vocab_size", "is 256 for the bytes tokenizer")
        if self.kind == "chars":
            if len(self.vocab) != self.vocab_size or self.vocab_size > MAX_CHARS_VOCAB:
                raise InvalidRecord(
                    "dataset.tokenizer.vocab",
                    f"must hold vocab_size ({self.vocab_size}) characters, got {len(self.vocab)}",
                )
            points = [ord(c) for c in self.vocab]
            if any(a >= b for a, b in itertools.pairwise(points)):
                raise InvalidRecord(
                    "dataset.tokenizer.vocab", "must be distinct characters in code point order"
                )
        elif self.vocab:
            raise InvalidRecord("dataset.tokenizer.vocab", f"is for chars, not {self.kind}")
        if self.name:
            rules.check_text("dataset.tokenizer.name", self.name, 128)

    @property
    def tokens(self) -> tuple[str, ...] | None:
        """The string of each token id, when the dataset records them (``chars``)."""
        return tuple(self.vocab) if self.kind == "chars" else None


class DatasetManifest(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """A dataset as shards: ``shards`` are what leases take; ``validation`` (``sharded``
    only) are held-out shards no lease ever names, which built-in workloads validate on;
    ``tokenizer`` says how the token ids of a text dataset were made.

    The fields added after the first version (``validation``, ``tokenizer``) are left out
    of the encoding while they hold their defaults, so a manifest without them encodes (and
    hashes) as it did before they existed; ``kind`` is always encoded (its default is
    filled in after construction)."""

    name: str
    shards: tuple[ShardInfo, ...]
    #: Given as "" (or left out), it becomes ``indexed``.
    kind: str = ""
    validation: tuple[ShardInfo, ...] = ()
    tokenizer: TokenizerSpec | None = None

    def __post_init__(self) -> None:
        if not self.kind:
            msgspec.structs.force_setattr(self, "kind", "indexed")
        rules.check_name("dataset.name", self.name)
        rules.check_count("dataset.shards", self.shards, 1, MAX_SHARDS)
        rules.check_sorted_unique("dataset.shards", [s.name for s in self.shards])
        rules.check_choice("dataset.kind", self.kind, DATA_KINDS)
        rules.check_count("dataset.validation", self.validation, 0, MAX_SHARDS)
        rules.check_sorted_unique("dataset.validation", [s.name for s in self.validation])
        if self.validation and self.kind != "sharded":
            raise InvalidRecord(
                "dataset.validation", "only a sharded dataset (prepared shard files) has one"
            )
        both = {s.name for s in self.shards} & {s.name for s in self.validation}
        if both:
            raise InvalidRecord(
                "dataset.validation",
                f"shard {min(both)!r} is both a training and a validation shard",
            )
        if self.kind == "sharded":
            for shard in (*self.shards, *self.validation):
                if shard.bytes < 1:
                    raise InvalidRecord(
                        "dataset.shards.bytes",
                        f"shard {shard.name!r} of a sharded dataset must give its size in bytes",
                    )

    @property
    def total_bytes(self) -> int:
        """The size of every training shard file (0 unless the dataset is ``sharded``)."""
        return sum(s.bytes for s in self.shards)

    @property
    def total_samples(self) -> int:
        """The training samples (the validation shards' are not counted)."""
        return sum(s.samples for s in self.shards)

    @property
    def validation_samples(self) -> int:
        return sum(s.samples for s in self.validation)

    @property
    def all_shards(self) -> tuple[ShardInfo, ...]:
        """The training shards, then the validation shards."""
        return (*self.shards, *self.validation)


class InnerOptimizerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The trainer-local optimizer (its state stays on the trainer across windows), and the
    schedule of its learning rate over the run.

    The schedule scales every parameter group's learning rate (as the workload built it) by
    :meth:`lr_scale` of the window being trained, so every trainer of a window trains at
    the same rate: ``warmup_windows`` windows rising linearly to 1, then ``constant`` (1
    from there on) or ``cosine`` (from 1 down to ``min_lr_ratio`` over ``decay_windows``
    windows, then ``min_lr_ratio``; the DiLoCo recipe's inner schedule).
    """

    name: str = "adamw"
    lr: float = 1e-3
    config: Config = {}
    schedule: str = "constant"
    warmup_windows: int = 0
    decay_windows: int = 0
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        rules.check_choice("inner_optimizer.name", self.name, INNER_OPTIMIZERS)
        rules.check_float("inner_optimizer.lr", self.lr, 0.0, 10.0)
        check_config("inner_optimizer.config", self.config)
        rules.check_choice("inner_optimizer.schedule", self.schedule, INNER_SCHEDULES)
        rules.check_int("inner_optimizer.warmup_windows", self.warmup_windows, 0, 1_000_000)
        rules.check_int("inner_optimizer.decay_windows", self.decay_windows, 0, 1_000_000)
        rules.check_float("inner_optimizer.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        if self.schedule == "cosine" and self.decay_windows < 1:
            raise InvalidRecord(
                "inner_optimizer.decay_windows",
                "must be at least 1 for the cosine schedule: set it to the windows the run "
                "is planned to last",
            )

    @property
    def scheduled(self) -> bool:
        """Whether the learning rate changes from window to window."""
        return self.schedule != "constant" or self.warmup_windows > 0

    def lr_scale(self, window: int) -> float:
        """The factor on the inner learning rate while window ``window`` (1 = the first)
        trains."""
        if window <= self.warmup_windows:
            return window / self.warmup_windows
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (window - self.warmup_windows - 1) / self.decay_windows)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine


class OuterOptimizerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The outer step applied to the aggregate pseudo-gradient (DiLoCo: Nesterov 0.7/0.9)."""

    name: str = "nesterov"
    lr: float = 0.7
    momentum: float = 0.9

    def __post_init__(self) -> None:
        rules.check_choice("outer_optimizer.name", self.name, OUTER_OPTIMIZERS)
        rules.check_float("outer_optimizer.lr", self.lr, 0.0, 10.0)
        rules.check_float("outer_optimizer.momentum", self.momentum, 0.0, 0.999)
        if self.name == "sgd" and self.momentum != 0.0:
            raise InvalidRecord("outer_optimizer.momentum", "plain 'sgd' takes momentum 0")


class WindowSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How long a window waits for updates and how many it takes: the deadline is
    ``deadline_s`` after the window's first update; ``proposal_s`` is each
    proposer's slot after the deadline (the ranked reducers, then the ranked validators
    falling back, see ``protocol.proposers``)."""

    deadline_s: float = 60.0
    min_updates: int = 1
    max_updates: int = 1000
    proposal_s: float = 15.0
    #: How many heads an update may lag: an update of window ``w`` builds on the head at
    #: height ``w - 1`` (staleness 0) or on one of the ``staleness`` heads before it. With
    #: 1, trainers train window ``w + 1`` while window ``w`` is being certified.
    staleness: int = 0

    def __post_init__(self) -> None:
        rules.check_int("window.staleness", self.staleness, 0, MAX_STALENESS)
        rules.check_float("window.deadline_s", self.deadline_s, 0.01, 86400.0)
        rules.check_float("window.proposal_s", self.proposal_s, 0.01, 86400.0)
        rules.check_int("window.min_updates", self.min_updates, 1, 1_000_000)
        rules.check_int("window.max_updates", self.max_updates, self.min_updates, 1_000_000)


class CodecSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How trainers encode pseudo-gradients."""

    name: str = "int8"
    config: Config = {}

    def __post_init__(self) -> None:
        rules.check_choice("codec.name", self.name, UPDATE_CODECS)
        check_config("codec.config", self.config)


class AggregationSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The robust aggregation rule and its parameters, and the precision of the aggregate
    the outer step applies (and followers download)."""

    rule: str = "trimmed_mean"
    config: Config = {}
    precision: str = "fp32"

    def __post_init__(self) -> None:
        rules.check_choice("aggregation.rule", self.rule, AGGREGATION_RULES)
        check_config("aggregation.config", self.config)
        rules.check_choice("aggregation.precision", self.precision, AGGREGATE_PRECISIONS)


class ScreeningSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Thresholds for screening updates from their tensors, and quarantine policy."""

    max_norm_ratio: float = 3.0
    min_cosine: float = 0.0
    quarantine_after: int = 3
    quarantine_windows: int = 5

    def __post_init__(self) -> None:
        rules.check_float("screening.max_norm_ratio", self.max_norm_ratio, 1.0, 1e6)
        rules.check_float("screening.min_cosine", self.min_cosine, -1.0, 1.0)
        rules.check_int("screening.quarantine_after", self.quarantine_after, 1, 1000)
        rules.check_int("screening.quarantine_windows", self.quarantine_windows, 1, 1_000_000)


class ExperimentManifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The immutable definition of one training run (a revision). Signed by ``authority``."""

    network_id: str
    study: str
    name: str
    revision: int = 1
    parent: str | None = None
    start_head: str | None = None
    authority: bytes
    workload: WorkloadSpec
    dataset: DatasetManifest
    protocol: str = "diloco"
    inner_optimizer: InnerOptimizerSpec = InnerOptimizerSpec()
    inner_steps: int = 50
    outer_optimizer: OuterOptimizerSpec = OuterOptimizerSpec()
    window: WindowSpec = WindowSpec()
    codec: CodecSpec = CodecSpec()
    aggregation: AggregationSpec = AggregationSpec()
    screening: ScreeningSpec = ScreeningSpec()
    validators: tuple[bytes, ...]
    quorum: int
    lease_size: int
    genesis_weights: str
    #: Reducers' public keys (sorted): they propose first, in rendezvous order, before the
    #: validators fall back to proposing themselves. Every participant must agree on them.
    reducers: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        rules.check_hex_id("network_id", self.network_id)
        rules.check_name("study", self.study)
        rules.check_name("name", self.name)
        rules.check_int("revision", self.revision, 1)
        rules.check_optional_hex_id("parent", self.parent)
        rules.check_optional_hex_id("start_head", self.start_head)
        if (self.parent is None) != (self.start_head is None):
            raise InvalidRecord("start_head", "a revision names both its parent and start head")
        if self.revision == 1 and self.parent is not None:
            raise InvalidRecord("parent", "revision 1 has no parent; later revisions need one")
        rules.check_public_key("authority", self.authority)
        rules.check_choice("protocol", self.protocol, TRAINING_PROTOCOLS)
        if self.protocol == "fedavg" and (
            self.outer_optimizer.name != "sgd" or self.outer_optimizer.lr != 1.0
        ):
            raise InvalidRecord(
                "outer_optimizer", "protocol 'fedavg' means outer 'sgd' with lr 1.0, momentum 0"
            )
        rules.check_int("inner_steps", self.inner_steps, 1, 1_000_000)
        self._check_validators()
        rules.check_int("lease_size", self.lease_size, 1, self.dataset.total_samples)
        rules.check_hex_id("genesis_weights", self.genesis_weights)

    def _check_validators(self) -> None:
        rules.check_count("validators", self.validators, 1, MAX_VALIDATORS)
        rules.check_sorted_unique("validators", self.validators)
        for i, key in enumerate(self.validators):
            rules.check_public_key(f"validators[{i}]", key)
        rules.check_int("quorum", self.quorum, 1, len(self.validators))
        rules.check_count("reducers", self.reducers, 0, MAX_VALIDATORS)
        rules.check_sorted_unique("reducers", self.reducers)
        for i, key in enumerate(self.reducers):
            rules.check_public_key(f"reducers[{i}]", key)

    @property
    def id(self) -> str:
        """The experiment id: SHA-256 of the canonical encoding."""
        return record_id(self)

    def minority_quorum_problem(self, opt_in: str) -> str | None:
        """Why this experiment's quorum is unsafe (None: it is a majority); ``opt_in`` names
        how the operator accepts the risk where the experiment is created."""
        return minority_quorum_problem(self.quorum, len(self.validators), opt_in)

    @property
    def has_majority_quorum(self) -> bool:
        """True when any two quorums share a validator (q > n/2): certifying two heads at
        one height then needs at least one validator to sign both (to equivocate)."""
        return 2 * self.quorum > len(self.validators)

    @property
    def tolerated_equivocators(self) -> int:
        """How many equivocating validators the quorum survives: two quorums overlap in
        2q - n validators, and safety needs an honest one in every overlap."""
        return max(0, 2 * self.quorum - len(self.validators) - 1)
