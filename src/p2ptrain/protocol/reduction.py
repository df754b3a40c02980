"""The reduction of one window: admission, screening, aggregation and the outer step.

Reducers and validators run exactly this on the same cohort and, the arithmetic being
bit-exact, reach the same head id -- which is what lets a validator sign a reducer's head,
or propose the same head itself when the reducer fails (DESIGN §4 steps 4-6).

A cohort is the updates a proposal names (accepted and rejected). Each one must be for the
window being reduced (experiment, window, base head: :func:`belongs_to_window`); within it an
update is *rejected*, with a reason and a strike for its trainer (:mod:`.quarantine`), when
its lease is not the trainer's lease, its trainer sent another update this window, its blob
does not match or decode, or screening turns it down; an update from an excluded trainer is
rejected without a strike. The survivors are aggregated with the manifest's rule (weights:
the lease sample counts), and the outer optimizer steps the base weights.
"""

from __future__ import annotations

import functools
import hashlib
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from p2ptrain.aggregate.aggregate_blob import settle_aggregate, settles_unchanged
from p2ptrain.aggregate.codecs import codec_at, max_update_bytes, precision_at
from p2ptrain.aggregate.exact import unflatten
from p2ptrain.aggregate.outer import OuterOptimizer, make_outer_optimizer
from p2ptrain.aggregate.rules import RankedRule, StreamingRule, make_rule
from p2ptrain.aggregate.rules_basic import Ranked
from p2ptrain.aggregate.screening import (
    Centre,
    Checked,
    ScreeningOutcome,
    measure,
    measure_with_centre,
    screen_cohort,
)
from p2ptrain.aggregate.update_reader import ByteSource, MemoryBytes, UpdateVector, source_of
from p2ptrain.core.certificate import Verdict
from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.reasons import Code, Reason
from p2ptrain.core.records import Head, Rejection, Update
from p2ptrain.core.spool import Blob, BlobSpool, SpooledBlob
from p2ptrain.core.tensors import (
    StateLayout,
    TensorSpec,
    blank_state_blob,
    schema_of,
    state_layout,
    state_views,
)
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.protocol.leases import LeaseBook
from p2ptrain.protocol.quarantine import excluded_until, next_standings

__all__ = [
    "KEEP_DECODED_BYTES",
    "BaseState",
    "ByteSource",
    "MemoryBytes",
    "Reduction",
    "Stepped",
    "Submission",
    "belongs_to_window",
    "blob_ids",
    "outer_step",
    "reduce_window",
]

Tensors = Mapping[str, torch.Tensor]
#: Bytes per read when a reduction hashes a blob itself.
_HASH_READ = 1 << 24
#: Values per slice of a spooled outer step (16 MB of float32 per output).
_STEP_SLICE = 1 << 22
#: A cohort whose decoded updates fit in this many bytes (float32) is decoded once: its
#: later passes (screening's, the rule's) copy the values the first pass decoded. A larger
#: one streams every pass from the blobs, holding a window of each at a time.
KEEP_DECODED_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class BaseState:
    """The canonical head a window builds on, with its weights and outer-optimizer state."""

    head: Head
    head_id: str
    weights: Tensors
    optimizer_state: Tensors | None = None
    #: The encoded aggregate that stepped the parent to this head, when this role holds it
    #: (it computed the head or applied the aggregate itself): peers fetch it from us.
    aggregate: Blob | None = None

    @property
    def window(self) -> int:
        """The window that builds on this head."""
        return self.head.height + 1


@dataclass(frozen=True, slots=True)
class Submission:
    """An update record (its signature already verified) and the bytes of its blob."""

    update: Update
    update_id: str
    #: The bytes in memory, or where to read them by range (a blob store's file).
    blob: bytes | bytearray | ByteSource


@dataclass(frozen=True, slots=True)
class Reduction:
    """The outcome of reducing a window's cohort: the next head (None, with the reason,
    when the window cannot produce one), its blobs and every rejection."""

    window: int
    accepted: tuple[str, ...]
    rejected: tuple[Rejection, ...]
    reason: str
    head: Head | None = None
    head_id: str | None = None
    weights: dict[str, torch.Tensor] | None = None
    weights_blob: Blob | None = None
    optimizer_state: dict[str, torch.Tensor] | None = None
    optimizer_blob: Blob | None = None
    aggregate_blob: Blob | None = None


@dataclass(frozen=True, slots=True)
class Stepped:
    """The next weights and outer-optimizer state, and their canonical blobs (the head's
    ``weights_blob`` and ``optimizer_blob`` are their hashes)."""

    weights: dict[str, torch.Tensor]
    weights_blob: Blob
    optimizer_state: dict[str, torch.Tensor] | None
    optimizer_blob: Blob | None


def outer_step(
    manifest: ExperimentManifest,
    base: BaseState,
    pseudo_gradient: Tensors,
    spool: BlobSpool | None = None,
) -> Stepped:
    """The manifest's outer step of ``base`` by the aggregate ``pseudo_gradient``: what a
    reducer or validator computes for its proposal, and what a follower holding ``base``
    computes from the head's aggregate (the same bits, so the same hashes). The new weights
    and state are written straight into their blobs' bytes (the tensors are views of them):
    encoding them costs no copy. With ``spool``, the blobs are written a few megabytes at a
    time into its sinks (files, say), and the tensors are views of the finished blobs."""
    optimizer = make_outer_optimizer(manifest.outer_optimizer)
    schema = schema_of(base.weights)
    specs = {spec.name: spec for spec in schema}
    state_names = optimizer.state_names(specs)
    if spool is not None:
        state_of = {name: key for key, name in state_names.items()}
        return _spooled_step(
            optimizer, base, pseudo_gradient, spool=spool, schema=schema, state_of=state_of
        )
    weights_blob, weights = blank_state_blob(schema)
    optimizer_blob: bytearray | None = None
    state: dict[str, torch.Tensor] = {}
    if state_names:
        optimizer_blob, state = blank_state_blob(
            TensorSpec(key, specs[name].shape, "float32") for key, name in state_names.items()
        )
    optimizer.step_into(
        base.weights,
        pseudo_gradient,
        base.optimizer_state,
        new_params=weights,
        new_state=state,
    )
    return Stepped(
        weights=weights,
        weights_blob=weights_blob,
        optimizer_state=state or None,
        optimizer_blob=optimizer_blob,
    )


def _spooled_step(
    optimizer: OuterOptimizer,
    base: BaseState,
    pseudo_gradient: Tensors,
    *,
    spool: BlobSpool,
    schema: Sequence[TensorSpec],
    state_of: Mapping[str, str],
) -> Stepped:
    """:func:`outer_step` a slice of a parameter at a time (elementwise, so the same bits),
    each slice of the new weights and state (``state_of``: each parameter's state entry)
    written into its blob's sink at its offset."""
    old_state = base.optimizer_state or None
    if old_state is not None and set(old_state) != set(state_of.values()):
        raise LocalError(
            "the outer optimizer state does not match the weights; pass the state saved with "
            "these weights, or an empty one to start from zero momentum"
        )
    weights_layout = state_layout(schema)
    weights_sink = spool.open(weights_layout.size)
    weights_sink.write(0, weights_layout.prefix)
    state_schema = [
        TensorSpec(state_of[spec.name], spec.shape, "float32")
        for spec in schema
        if spec.name in state_of
    ]
    state_out = state_layout(state_schema) if state_schema else None
    state_sink = None if state_out is None else spool.open(state_out.size)
    if state_sink is not None and state_out is not None:
        state_sink.write(0, state_out.prefix)
    new_theta = torch.empty(_STEP_SLICE, dtype=torch.float32)
    new_buffer = torch.empty(_STEP_SLICE, dtype=torch.float32)
    for spec in schema:
        name, key = spec.name, state_of.get(spec.name)
        theta = base.weights[name].reshape(-1)
        g = pseudo_gradient[name].reshape(-1)
        old = None if old_state is None or key is None else old_state[key].reshape(-1)
        for first in range(0, theta.numel(), _STEP_SLICE):
            last = min(first + _STEP_SLICE, theta.numel())
            theta_out, buffer_out = new_theta[: last - first], new_buffer[: last - first]
            optimizer.step_into(
                {name: theta[first:last]},
                {name: g[first:last]},
                None if old is None or key is None else {key: old[first:last]},
                new_params={name: theta_out},
                new_state={} if key is None else {key: buffer_out},
            )
            weights_sink.write(weights_layout.entries[name][0] + 4 * first, theta_out.numpy().data)
            if key is not None and state_sink is not None and state_out is not None:
                state_sink.write(state_out.entries[key][0] + 4 * first, buffer_out.numpy().data)
    weights_blob = weights_sink.close()
    optimizer_blob = None if state_sink is None else state_sink.close()
    return Stepped(
        weights=_tensors_of(weights_blob, weights_layout),
        weights_blob=weights_blob,
        optimizer_state=(
            None
            if optimizer_blob is None or state_out is None
            else _tensors_of(optimizer_blob, state_out)
        ),
        optimizer_blob=optimizer_blob,
    )


def _tensors_of(blob: bytearray | SpooledBlob, layout: StateLayout) -> dict[str, torch.Tensor]:
    """A finished state blob's tensors, as views of it."""
    if isinstance(blob, bytearray):
        return state_views(blob, layout)
    return blob.tensors()


def belongs_to_window(
    manifest_id: str, base: BaseState, update: Update, bases: Collection[str] = ()
) -> Verdict:
    """Whether ``update`` is for the window built on ``base`` (else it is stale, replayed
    from another window or for another experiment, and belongs in no cohort). ``bases``:
    the heads an update of this window may build on (``base`` and, with a staleness
    allowance, the ones before it on the chain); empty means ``base`` alone."""
    if update.experiment_id != manifest_id:
        return Verdict(False, "update is for another experiment")
    if update.window != base.window:
        return Verdict(False, f"update is for window {update.window}, this is {base.window}")
    if update.base_head != base.head_id and update.base_head not in bases:
        return Verdict(
            False,
            f"update builds on head {update.base_head[:12]}, not {base.head_id[:12]}"
            + (f" or the {len(bases) - 1} before it" if len(bases) > 1 else ""),
        )
    return Verdict(True, "update is for this window")


@functools.cache
def _settlers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2ptrain-settle")


@functools.cache
def _hashers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=3, thread_name_prefix="p2ptrain-hash")


def blob_ids(*blobs: Blob | None) -> list[str | None]:
    """The SHA-256 ids of a head's blobs (None stays None), hashed at the same time on as
    many threads as there are blobs of real size (hashlib lets go of the GIL): a new
    state's weights and optimizer blobs are each as large as the model. A spooled blob is
    hashed from its file."""

    def hashed(blob: Blob) -> str:
        return sha256_hex(blob) if isinstance(blob, bytes | bytearray) else blob.blob_id

    large = [blob for blob in blobs if blob is not None and len(blob) >= _HASH_READ]
    if len(large) < 2:
        return [None if blob is None else hashed(blob) for blob in blobs]
    futures = [None if blob is None else _hashers().submit(hashed, blob) for blob in blobs]
    return [None if future is None else future.result() for future in futures]


def _blob_id(blob: ByteSource) -> str:
    """The id the blob's bytes hash to: as a store that verified them vouches, else hashed
    here a megabyte at a time."""
    if blob.verified_id is not None:
        return blob.verified_id
    digest = hashlib.sha256()
    size = len(blob)
    for offset in range(0, size, _HASH_READ):
        digest.update(blob.read(offset, min(_HASH_READ, size - offset)))
    return digest.hexdigest()


def _admit(
    manifest: ExperimentManifest,
    base: BaseState,
    submission: Submission,
    leases: LeaseBook,
    repeated: bool,
) -> tuple[Reason | None, bool]:
    """(None or the rejection reason, whether it counts as a strike)."""
    update = submission.update
    until = excluded_until(base.head.quarantine, update.trainer_id, base.window)
    if until is not None:
        return Reason(Code.QUARANTINED, (until,)), False
    if repeated:
        return Reason(Code.REPEATED), True
    expected = codec_at(manifest.codec, update.window).name
    if update.codec != expected:
        return Reason(Code.WRONG_CODEC, (update.codec[:64], expected)), True
    problem = leases.check(update)
    if problem is not None:
        return problem, True
    blob = source_of(submission.blob)
    if len(blob) != update.delta_bytes or _blob_id(blob) != update.delta_blob:
        return Reason(Code.BLOB_MISMATCH), True
    return None, True


class _Verdicts:
    """A cohort's rejections as a reduction reaches them, and the strikes they carry."""

    def __init__(self, ordered: Sequence[Submission]) -> None:
        self.trainer_of = {s.update_id: s.update.trainer_id for s in ordered}
        self.rejections: dict[str, Reason] = {}
        self.struck: dict[str, Reason] = {}

    def reject(self, update_id: str, problem: Reason, strike: bool = True) -> None:
        self.rejections[update_id] = problem
        if strike:
            self.struck[self.trainer_of[update_id]] = problem

    def rejected(self) -> tuple[Rejection, ...]:
        return tuple(Rejection(update_id=i, reason=r) for i, r in sorted(self.rejections.items()))

    def screen(
        self,
        manifest: ExperimentManifest,
        base: BaseState,
        ordered: Sequence[Submission],
        leases: LeaseBook,
        rule: StreamingRule,
    ) -> tuple[ScreeningOutcome, Ranked | None]:
        """Admit, open, read once (:func:`measure`) and screen the cohort's updates; with a
        trimmed ``rule``, that one read also takes the rule's mean of every opened update
        (:class:`Ranked`: the rule's result when screening accepts them all)."""
        per_trainer = Counter(s.update.trainer_id for s in ordered)
        schema = schema_of(base.weights)
        opened: list[tuple[Submission, UpdateVector]] = []
        for submission in ordered:
            repeated = per_trainer[submission.update.trainer_id] > 1
            problem, strike = _admit(manifest, base, submission, leases, repeated)
            if problem is not None:
                self.reject(submission.update_id, problem, strike)
                continue
            try:
                # only the blob's headers are read here; its values, a window at a time
                codec = codec_at(manifest.codec, submission.update.window)
                limit = max_update_bytes(codec, schema)
                vector = UpdateVector(submission.blob, codec, schema, max_bytes=limit)
            except ProtocolViolation:
                self.reject(submission.update_id, Reason(Code.UNDECODABLE))
            else:
                opened.append((submission, vector))
        # the first pass reads every value of every update once: bad values, non-finite ones,
        # the norms and (on the bet that none is turned down on its norm) the centre
        candidates: list[Checked] = []
        vectors = [vector for _, vector in opened]
        if sum(vector.numel() for vector in vectors) * 4 <= KEEP_DECODED_BYTES:
            for vector in vectors:  # the later passes copy what the first one decoded
                vector.keep_decoded()
        trim = rule.trim_for(len(vectors)) if isinstance(rule, RankedRule) and vectors else None
        ahead = measure_with_centre(vectors, trim)
        centre: Centre | None = None
        ranked: Ranked | None = None
        norms: Sequence[float | str]
        if ahead is None:
            norms = measure(vectors)
        else:
            norms = ahead.norms
            update_ids = tuple(submission.update_id for submission, _ in opened)
            centre = Centre(update_ids, ahead.dots, ahead.centre_norm)
            if ahead.mean is not None and trim is not None:
                ranked = Ranked(update_ids, trim, ahead.mean, ahead.distances, ahead.dropped)
        for (submission, vector), norm in zip(opened, norms, strict=True):
            if isinstance(norm, str):
                self.reject(submission.update_id, Reason(Code.UNDECODABLE))
            else:
                weight = float(submission.update.lease_samples)
                candidates.append(Checked(submission.update_id, vector, weight, norm))
        outcome = screen_cohort(candidates, schema, manifest.screening, centre)
        for screened in outcome.verdicts:
            if screened.reason is not None:
                self.reject(screened.update_id, screened.reason)
        return outcome, ranked


def reduce_window(
    manifest: ExperimentManifest,
    base: BaseState,
    cohort: Sequence[Submission],
    leases: LeaseBook,
    bases: Collection[str] = (),
    *,
    spool: BlobSpool | None = None,
) -> Reduction:
    """Reduce ``cohort`` (in any order) on ``base``. Raises :class:`LocalError` when the
    cohort holds an update that is not for this window (``bases``: as for
    :func:`belongs_to_window`) or is larger than ``window.max_updates`` -- a caller that
    builds cohorts must filter first (a proposal that names such a cohort is invalid:
    ``Participant`` judges it so). The aggregate of updates built on older heads steps
    ``base`` like the others (one-step-delayed outer steps). With ``spool``, the head's
    blobs are written into its sinks (files: the reduction then holds none of them in
    memory) and the reduction's tensors are views of them."""
    window = base.window
    if len(cohort) > manifest.window.max_updates:
        raise LocalError(f"a cohort of {len(cohort)} updates exceeds window.max_updates")
    # one submission per update id: the same update relayed twice is one update
    ordered = sorted({s.update_id: s for s in cohort}.values(), key=lambda s: s.update_id)
    for submission in ordered:
        verdict = belongs_to_window(leases.experiment_id, base, submission.update, bases)
        if not verdict:
            raise LocalError(f"update {submission.update_id[:12]}: {verdict.reason}")
    verdicts = _Verdicts(ordered)
    rule = make_rule(manifest.aggregation)
    outcome, ranked = verdicts.screen(manifest, base, ordered, leases, rule)
    accepted = tuple(c.update_id for c in outcome.contributions)
    rejected = verdicts.rejected()

    def without_head(reason: str) -> Reduction:
        return Reduction(window=window, accepted=accepted, rejected=rejected, reason=reason)

    if len(accepted) < manifest.window.min_updates:
        return without_head(
            f"{len(accepted)} updates passed screening, the window needs "
            f"{manifest.window.min_updates}"
        )
    result = None
    if ranked is not None and isinstance(rule, RankedRule):
        # the first pass took the rule's mean of every opened update: the result when
        # screening accepted them all (else the buffer takes the rule's own pass)
        result = rule.from_ranked(outcome.contributions, outcome.failures, ranked)
    if result is None:
        out = None if ranked is None else ranked.aggregate
        result = rule.aggregate(outcome.contributions, outcome.failures, out=out)
    del ranked
    if result.aggregate is None:
        return without_head(f"aggregation produced nothing: {result.reason}")
    rule_reason = result.reason
    aggregate = unflatten(result.aggregate, base.weights, copy=False)
    precision = precision_at(manifest.codec, manifest.aggregation.precision, window)
    del result, outcome  # in memory, the aggregate's values are in its blob now
    if spool is not None and settles_unchanged(precision):
        # the outer step applies the aggregate's own values: its blob is written (and
        # hashed) on another thread meanwhile
        settling = _settlers().submit(settle_aggregate, aggregate, precision, spool)
        try:
            step = outer_step(manifest, base, aggregate, spool)
        finally:
            _, aggregate_blob = settling.result()
    else:
        # the rule's vector is ours: rounded where it lies
        pseudo_gradient, aggregate_blob = settle_aggregate(
            aggregate, precision, spool, in_place=True
        )
        step = outer_step(manifest, base, pseudo_gradient, spool)
        del pseudo_gradient
    del aggregate
    standings = next_standings(
        base.head.quarantine,
        window,
        accepted=[verdicts.trainer_of[i] for i in accepted],
        rejected=verdicts.struck,
        spec=manifest.screening,
    )
    weights_id, optimizer_id, aggregate_id = blob_ids(
        step.weights_blob, step.optimizer_blob, aggregate_blob
    )
    assert weights_id is not None and aggregate_id is not None  # both blobs exist
    head = Head(
        experiment_id=leases.experiment_id,
        height=window,
        parent=base.head_id,
        weights_blob=weights_id,
        optimizer_blob=optimizer_id,
        accepted=accepted,
        quarantine=standings,
        aggregate_blob=aggregate_id,
    )
    return Reduction(
        window=window,
        accepted=accepted,
        rejected=rejected,
        reason=f"{len(accepted)} accepted, {len(rejected)} rejected; {rule_reason}",
        head=head,
        head_id=head.id,
        weights=step.weights,
        weights_blob=step.weights_blob,
        optimizer_state=step.optimizer_state,
        optimizer_blob=step.optimizer_blob,
        aggregate_blob=aggregate_blob,
    )
