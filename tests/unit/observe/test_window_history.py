"""The window history and the telemetry's counters: hand-built heads, certificates and
updates, and the figures they must give."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2ptrain.core.certificate import QuorumCertificate, ValidatorSignature
from p2ptrain.core.identity import peer_id_of
from p2ptrain.core.reasons import ARITY, Code, Reason, describe
from p2ptrain.core.records import Head, Proposal, QuarantineEntry, Rejection, Update
from p2ptrain.net.net_metrics import exposition
from p2ptrain.observe.status import NodeStatus
from p2ptrain.observe.telemetry import NodeTelemetry, node_families
from p2ptrain.observe.window_history import (
    WindowHistory,
    read_history,
    reason_label,
    rejections,
)

EXPERIMENT = "e" * 64
KEYS = [bytes([i]) * 32 for i in range(1, 5)]
PEERS = [peer_id_of(k) for k in KEYS]


def _head(height: int, accepted: tuple[str, ...] = (), quarantine: tuple = ()) -> Head:
    return Head(
        experiment_id=EXPERIMENT,
        height=height,
        parent=None if height == 0 else f"{height - 1:064x}",
        weights_blob=f"{height + 100:064x}",
        optimizer_blob=None,
        accepted=accepted,
        quarantine=tuple(sorted(quarantine, key=lambda q: q.peer_id)),
        aggregate_blob=None if height == 0 else f"{height + 200:064x}",
    )


def _certificate(height: int, signers: list[bytes]) -> QuorumCertificate:
    return QuorumCertificate(
        experiment_id=EXPERIMENT,
        height=height,
        head_id=f"{height:064x}",
        round=0,
        signatures=tuple(ValidatorSignature(validator=k, signature=b"s" * 64) for k in signers),
    )


def _update(trainer: bytes, window: int, loss: float, blob: int) -> Update:
    return Update(
        experiment_id=EXPERIMENT,
        window=window,
        base_head=f"{window - 1:064x}",
        trainer=trainer,
        lease_shards=("a" * 64,),
        lease_samples=8,
        delta_blob=f"{blob:064x}",
        delta_bytes=100,
        codec="int8",
        loss_before=loss + 1,
        loss_after=loss,
    )


NORM = Reason(Code.NORM_ABOVE, (9.5, 3.0))
REPEATED = Reason(Code.REPEATED)


def _entry(peer: str, strikes: int, until: int = 0, reason: Reason = NORM) -> QuarantineEntry:
    return QuarantineEntry(peer_id=peer, until_window=until, reason=reason, strikes=strikes)


def test_rejections_are_the_entries_a_head_struck_again() -> None:
    parent = _head(1, quarantine=(_entry(PEERS[0], 1),))
    head = _head(
        2,
        quarantine=(
            _entry(PEERS[0], 1),  # unchanged: not this window's
            _entry(PEERS[1], 1, reason=Reason(Code.NORM_ABOVE, (1e3, 3.2))),
        ),
    )
    assert [e.peer_id for e in rejections(head, parent)] == [PEERS[1]]
    assert [e.peer_id for e in rejections(parent, None)] == [PEERS[0]]
    # the third strike quarantines: strikes start again from 0, offences count one more
    third = _head(
        3,
        quarantine=(
            QuarantineEntry(peer_id=PEERS[1], until_window=8, reason=NORM, strikes=0, offences=1),
        ),
    )
    struck_twice = _head(2, quarantine=(_entry(PEERS[1], 2),))
    assert [e.peer_id for e in rejections(third, struck_twice)] == [PEERS[1]]
    lapsed = _head(4, quarantine=(_entry(PEERS[1], 1),))
    assert rejections(lapsed, struck_twice) == []  # a strike lapsed: nothing rejected


def test_reason_labels_are_the_codes_names() -> None:
    assert reason_label(Reason(Code.NORM_ABOVE, (1007.6, 3.0))) == "norm_above"
    assert reason_label(Reason(Code.QUARANTINED, (8,))) == "quarantined"
    assert len({reason_label(Reason(code, ("x",) * ARITY[code])) for code in Code}) == len(Code)


@pytest.mark.parametrize("saw_the_proposal", [False, True])
def test_a_window_record_tells_each_updates_fate(tmp_path: Path, saw_the_proposal: bool) -> None:
    telemetry = NodeTelemetry(tmp_path)
    telemetry._adopted_at = 10.0  # the window opened at 10 s (the clock of this test)
    good = _update(KEYS[0], 1, 2.5, 1)
    bad = _update(KEYS[1], 1, 9.0, 2)
    late = _update(KEYS[2], 1, 2.6, 3)
    for i, update in enumerate((good, bad, late)):
        telemetry.saw_update(f"{i + 1:064x}", update, now=10.0 + i)
    telemetry.trained(1, 4.0, now=11.0)
    telemetry.published(1, now=11.5)
    why = Reason(Code.NOT_FINITE, ("w",))
    head = _head(1, accepted=(f"{1:064x}",), quarantine=(_entry(PEERS[1], 1, 3, why),))
    # the quarantine book keeps a standing's first reason; the proposal says this window's
    this_window = Reason(Code.NORM_ABOVE, (851.0, 3.0))
    proposal = Proposal(
        experiment_id=EXPERIMENT,
        window=1,
        base_head="0" * 64,
        reducer=KEYS[3],
        accepted=(f"{1:064x}",),
        rejected=(Rejection(update_id=f"{2:064x}", reason=this_window),),
        aggregate_blob=head.aggregate_blob or "",
        head=head,
    )
    other = msgspec.structs.replace(  # a proposal that was not certified
        proposal,
        head=_head(
            1, accepted=head.accepted, quarantine=(_entry(PEERS[2], 1, 3, Reason(Code.REPEATED)),)
        ),
        rejected=(),
    )
    for seen in (proposal, other) if saw_the_proposal else ():
        telemetry.saw_proposal(seen, now=13.0)
    if not saw_the_proposal:
        telemetry.mark(1, "proposal", 13.0)
    telemetry.attested(1, now=13.25)
    telemetry.certified(
        head,
        head.id,
        _head(0),
        _certificate(1, KEYS[2:4]),
        reason="certified",
        wire=(1000, 5000),
        now=14.0,
    )
    (record,) = telemetry.history.records()
    assert record.signers == (PEERS[2], PEERS[3])
    fates = {u.trainer: (u.outcome, u.reason, u.loss_after) for u in record.updates}
    assert fates[PEERS[0]] == ("accepted", "", 2.5)
    expected = describe(this_window if saw_the_proposal else why)
    assert fates[PEERS[1]] == ("rejected", expected, 9.0)
    assert fates[PEERS[2]][0] == "left out"
    assert [q.peer for q in record.quarantine] == [PEERS[1]]
    assert record.phases == {
        "train": 4.0,
        "publish": 0.5,
        "attest": 0.25,
        "certify": 0.75,
        "wait": 3.0,  # from the opening at 10 s to the first proposal at 13 s
    }
    assert (record.bytes_sent, record.bytes_received) == (1000, 5000)
    assert record.reason == "certified"
    assert telemetry.windows_certified == 1 and telemetry.updates_accepted == 1
    label = "norm_above" if saw_the_proposal else "not_finite"
    assert telemetry.updates_rejected == {label: 1}
    assert record.left_out == 1

    telemetry.history.set_validation(head.id, 2.25, 1)
    telemetry.history.save()
    (kept,) = read_history(tmp_path / "history.json")
    assert (kept.validation_loss, kept.validation_reports) == (2.25, 1)
    again = WindowHistory(tmp_path)
    again.load()
    again.add(kept)  # a restart adopts the stored tip again: kept once
    assert len(again.records()) == 1


def test_a_history_file_that_does_not_read_is_started_anew(tmp_path: Path) -> None:
    (tmp_path / "history.json").write_text("{not json")
    assert read_history(tmp_path / "history.json") == []
    assert read_history(tmp_path / "missing.json") == []


def test_bytes_are_filed_by_the_kind_of_blob() -> None:
    telemetry = NodeTelemetry()
    telemetry.blob_kind("b" * 64, "aggregate")
    telemetry.blob_bytes("sent", "b" * 64, 300)
    telemetry.blob_bytes("sent", "c" * 64, 7)  # never named: other
    telemetry.count_bytes("received", "shard", 1200)
    telemetry.fetched("d" * 64, "shard", 0.5)  # its bytes were counted as they landed
    telemetry.count_bytes("received", "nonsense", 5)
    assert telemetry.sent["aggregate"] == 300 and telemetry.sent["other"] == 7
    assert telemetry.received["shard"] == 1200 and telemetry.received["other"] == 5
    telemetry.window_failed(4, "deadline")
    telemetry.window_failed(4, "deadline")  # once per window
    telemetry.window_failed(5, "deadline")
    assert telemetry.windows_failed == {"deadline": 2}


@pytest.mark.parametrize("with_trainer", [False, True])
def test_every_family_is_typed_and_explained(with_trainer: bool) -> None:
    telemetry = NodeTelemetry()
    telemetry.phase(1, "train", 2.0)
    status = NodeStatus(
        peer_id="p" * 64,
        roles=("trainer",),
        address=None,
        experiment_id=EXPERIMENT,
        height=7,
        head_id="h" * 64,
        adopted_head_id="h" * 64,
        windows_certified=7,
        updates_accepted=12,
        updates_rejected={"norm_above": 2},
        bytes_sent_by_kind={"update": 10, "gossip": 3},
        bytes_received_by_kind={"state": 99},
    )
    text = exposition(lambda: list(node_families(status)), telemetry.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for family in families.values():
        assert family.type != "unknown" and family.documentation, family.name
    samples = {
        (s.name, tuple(s.labels.items())): s.value for f in families.values() for s in f.samples
    }
    assert samples["p2ptrain_height", ()] == 7
    assert samples["p2ptrain_windows_certified_total", ()] == 7
    assert samples["p2ptrain_updates_rejected_total", (("reason", "norm_above"),)] == 2
    assert samples["p2ptrain_bytes_sent_total", (("kind", "update"),)] == 10
    assert samples["p2ptrain_phase_seconds_count", (("phase", "train"),)] == 1
    # no reduction yet (or no reducer or validator): the families, without a sample
    assert families["p2ptrain_reduction_seconds"].samples == []
    assert families["p2ptrain_reduction_window"].samples == []


def test_the_last_reduction_is_a_gauge_of_its_seconds_and_window() -> None:
    status = NodeStatus(
        peer_id="p" * 64,
        roles=("validator",),
        address=None,
        experiment_id=EXPERIMENT,
        height=6,
        head_id="h" * 64,
        adopted_head_id="h" * 64,
        reduction_window=7,
        reduction_seconds=1.25,
        reduction_accepted=4,
        reductions_timed=3,
        reduction_seconds_total=3.5,
    )
    text = exposition(lambda: list(node_families(status))).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("p2ptrain_reduction_seconds", "p2ptrain_reduction_window"):
        assert families[name].type == "gauge" and families[name].documentation
    assert "seconds" in families["p2ptrain_reduction_seconds"].documentation.lower()
    assert [s.value for s in families["p2ptrain_reduction_seconds"].samples] == [1.25]
    assert [s.value for s in families["p2ptrain_reduction_window"].samples] == [7]
