"""What a node keeps in its data directory so that a restart resumes where it stopped.

* the signed network and experiment manifests it follows (records ``network`` and
  ``experiment``, and ``meta['experiment']`` naming the experiment);
* every certified head it adopted, as a :class:`CertifiedLink` (record ``certified`` under
  the certificate id, indexed in ``certified_heads``), and the head's weights and optimizer
  blobs in the blob store -- on restart the links are verified again from genesis
  (``HeadChain.catch_up``) before the tip's weights are used;
* a validator's votes (``meta['votes']``, a :class:`Ballot` per height): it never votes
  twice in one round, not even across a crash, and keeps its lock;
* signed updates and proposals it saw (records), which peers ask for by id;
* the signed metrics reports of certified heads (records ``metrics``, indexed by height and
  evaluator; at most one per evaluator and head, at most 64 evaluators per head, kept as
  long as the head);
* a trainer's inner optimizer state (``trainer-state.safetensors``), written atomically
  after each window, and the window it is training (``training-window``, removed when the
  window's training ends), so that a trainer killed in the middle of a window (a rank of
  its pod died, the machine ran out of memory) records that window's failure as it starts
  again.

SQLite commits and blob renames are atomic, and every write happens before the action that
depends on it (a vote is stored before the attestation is sent), so a crash at any point
leaves a state the node can resume from.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from p2ptrain.core.certificate import CertifiedLink, QuorumCertificate
from p2ptrain.core.encoding import decode, encode
from p2ptrain.core.envelope import Signed, open_envelope
from p2ptrain.core.records import Head, MetricsReport
from p2ptrain.core.tensors import decode_state_dict
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.protocol.ballot import Ballot
from p2ptrain.protocol.metrics import median
from p2ptrain.store.atomic import replace_atomically
from p2ptrain.store.datadir import DataDir

__all__ = ["METRICS_KIND", "TRAINER_STATE_FILE", "NodeStore", "median_val_loss"]

TRAINER_STATE_FILE = "trainer-state.safetensors"
_VOTES = "votes"
_EXPERIMENT = "experiment"
_LISTEN_PORT = "listen_port"
#: The window a trainer is training (see :meth:`NodeStore.begin_training`).
TRAINING_FILE = "training-window"
#: The kind of metrics reports, as records and on gossip.
METRICS_KIND = "metrics"
_MAX_LINK_BYTES = 1 << 20
#: Votes kept (by height); older ones can no longer matter.
_KEEP_VOTES = 64
#: The largest genesis weights a node decodes.
_MAX_GENESIS_BYTES = 4 << 30


class NodeStore:
    """The node's view of its :class:`DataDir`."""

    def __init__(self, datadir: DataDir) -> None:
        self.datadir = datadir
        self.state = datadir.state
        self.blobs = datadir.blobs

    # -- manifests ------------------------------------------------------------------------

    def experiment_id(self) -> str | None:
        raw = self.state.get_meta(_EXPERIMENT)
        return None if raw is None else raw.decode()

    def remember_experiment(self, experiment_id: str) -> None:
        current = self.experiment_id()
        if current is not None and current != experiment_id:
            raise LocalError(
                f"the data directory {self.datadir.path} follows experiment {current}, not "
                f"{experiment_id}; use another --dir for another experiment"
            )
        self.state.set_meta(_EXPERIMENT, experiment_id.encode())

    # -- where it listened -----------------------------------------------------------------

    def listen_port(self) -> int:
        """The port this node listened on last time (0: none recorded)."""
        raw = self.state.get_meta(_LISTEN_PORT)
        return int(raw) if raw is not None and raw.isdigit() else 0

    def remember_listen_port(self, port: int) -> None:
        self.state.set_meta(_LISTEN_PORT, str(port).encode())

    # -- the window a trainer is training -------------------------------------------------

    # A small file, not a database transaction: written before every window's training and
    # removed after it, it must cost the trainer nothing (no fsync: a power cut loses only
    # this record of a failure).

    def begin_training(self, window: int) -> None:
        self._training_path().write_text(str(window), encoding="ascii")

    def end_training(self) -> None:
        self._training_path().unlink(missing_ok=True)

    def interrupted_training(self) -> int | None:
        """The window whose training began and never ended (the process was killed), once:
        it is cleared."""
        path = self._training_path()
        try:
            raw = path.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            return None
        self.end_training()
        return int(raw) if raw.isdigit() else None

    def _training_path(self) -> Path:
        return self.datadir.path / TRAINING_FILE

    # -- certified heads ------------------------------------------------------------------

    def put_link(self, head: Head, certificate: QuorumCertificate) -> None:
        data = encode(CertifiedLink(head=head, certificate=certificate))
        self.state.put_record(
            certificate.id,
            "certified",
            data,
            experiment_id=head.experiment_id,
            height=head.height,
        )
        self.state.put_certified_head(head.experiment_id, head.height, head.id, certificate.id)

    def links(self, experiment_id: str) -> list[tuple[Head, QuorumCertificate]]:
        """Every stored certified head above genesis, in height order (unverified: hand them
        to ``HeadChain.catch_up``)."""
        links: list[tuple[Head, QuorumCertificate]] = []
        for _record_id, data in self.state.records("certified", experiment_id=experiment_id):
            try:
                link = decode(CertifiedLink, data, max_bytes=_MAX_LINK_BYTES)
            except ProtocolViolation as exc:
                raise LocalError(
                    f"a stored certified head in {self.state.path} does not decode ({exc}); "
                    "the database is damaged: move the data directory away and rejoin"
                ) from exc
            links.append((link.head, link.certificate))
        links.sort(key=lambda pair: pair[0].height)
        return links

    # -- votes ----------------------------------------------------------------------------

    def votes(self) -> dict[int, Ballot]:
        """What this validator voted at its last heights (:class:`Ballot` by height)."""
        raw = self.state.get_meta(_VOTES)
        if raw is None:
            return {}
        where = f"{self.datadir.path}: votes"
        return {
            int(height): Ballot.from_json(text, f"{where} at height {height}")
            for height, text in json.loads(raw).items()
        }

    def put_vote(self, height: int, ballot: Ballot) -> None:
        votes = self.votes()
        votes[height] = ballot
        kept = dict(sorted(votes.items())[-_KEEP_VOTES:])
        text = json.dumps({str(h): b.to_json() for h, b in kept.items()})
        self.state.set_meta(_VOTES, text.encode())

    # -- records --------------------------------------------------------------------------

    def put_signed(
        self, record_id: str, kind: str, envelope: bytes, experiment_id: str, height: int
    ) -> None:
        self.state.put_record(record_id, kind, envelope, experiment_id=experiment_id, height=height)

    def prune_signed(self, experiment_id: str, below_height: int) -> int:
        """Forget the updates and proposals of windows below ``below_height``."""
        return self.state.prune_records(("update", "proposal"), experiment_id, below_height)

    def record(self, record_id: str) -> bytes | None:
        return self.state.get_record(record_id)

    def window_record_ids(
        self, experiment_id: str, window: int, limit: int
    ) -> dict[str, list[str]]:
        """The ids of the updates and proposals of ``window`` kept here, by kind."""
        return {
            kind: self.state.record_ids(
                kind, experiment_id=experiment_id, height=window, limit=limit
            )
            for kind in ("update", "proposal")
        }

    # -- metrics reports ------------------------------------------------------------------

    def put_report(self, signed: Signed[MetricsReport]) -> bool:
        """Store a report the node's :class:`~p2ptrain.protocol.metrics.MetricsBook` took
        (it keeps the bounds); False if it was stored already."""
        report = signed.record
        return self.state.put_record(
            signed.record_id,
            METRICS_KIND,
            bytes(signed.envelope.encode()),
            experiment_id=report.experiment_id,
            height=report.height,
            signer=report.evaluator_id,
        )

    def metrics_reports(
        self, experiment_id: str, *, height: int | None = None, min_height: int = 0
    ) -> list[MetricsReport]:
        """The stored reports of the experiment (at ``height``, or from ``min_height``)."""
        rows = self.state.records(METRICS_KIND, experiment_id=experiment_id, height=height)
        reports = []
        for _record_id, raw in rows:
            try:
                report = open_envelope(raw, MetricsReport).record
            except ProtocolViolation as exc:
                raise LocalError(
                    f"a stored metrics report in {self.state.path} does not verify ({exc}); "
                    "the database is damaged: move the data directory away and rejoin"
                ) from exc
            if report.height >= min_height:
                reports.append(report)
        return reports

    def reports_for(self, head_id: str) -> list[MetricsReport]:
        """The stored reports of the certified head ``head_id`` (none for another head)."""
        experiment_id = self.experiment_id()
        if experiment_id is None:
            return []
        height = self.state.certified_height(experiment_id, head_id)
        if height is None:
            return []
        reports = self.metrics_reports(experiment_id, height=height)
        return [r for r in reports if r.head_id == head_id]

    # -- trainer state --------------------------------------------------------------------

    def trainer_state_path(self) -> Path:
        return self.datadir.path / TRAINER_STATE_FILE

    def save_trainer_state(
        self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
    ) -> None:
        contiguous = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
        # streamed to the file: the moments (twice the weights) are not copied into bytes
        replace_atomically(
            self.trainer_state_path(),
            lambda temporary: save_file(contiguous, str(temporary), metadata=dict(metadata)),
        )

    def load_trainer_state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        """Our own file, written by :meth:`save_trainer_state` (never bytes from a peer)."""
        path = self.trainer_state_path()
        if not path.exists():
            return None
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = dict(handle.metadata() or {})
            return load_file(str(path)), metadata
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
            raise LocalError(
                f"cannot read the trainer state {path}: {exc}; delete it to restart the "
                "inner optimizer from scratch"
            ) from exc


def median_val_loss(store: NodeStore, head_id: str) -> tuple[float | None, int]:
    """The median validation loss evaluators reported for ``head_id`` and how many reports
    there are ((None, 0) without any): what an exporter writes in a model card."""
    losses = [report.loss for report in store.reports_for(head_id)]
    return median(losses), len(losses)


def decode_genesis(blob: bytes | bytearray) -> dict[str, torch.Tensor]:
    """The genesis weights from their blob (a LocalError when they do not decode)."""
    try:
        return decode_state_dict(blob, max_bytes=_MAX_GENESIS_BYTES)
    except ProtocolViolation as exc:
        raise LocalError(f"the genesis weights do not decode: {exc}") from exc
