"""What each simulated node sends when it trains, proposes or attests: honest behaviour,
Byzantine trainers (the attacks of :mod:`p2ptrain.sim.attacks`) and the protocol
adversaries of :data:`p2ptrain.sim.scenario.ADVERSARIES`. They act through the public
:class:`~p2ptrain.sim.outbox.Outbox` only, as a peer on the wire would.

Byzantine trainers collude but are not omniscient here: each forges from its own honest
update (``AttackContext.honest`` is that update alone).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import torch

from p2ptrain.aggregate.codecs import WindowEncoders
from p2ptrain.aggregate.exact import flatten, unflatten
from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.envelope import Envelope, Signed, seal
from p2ptrain.core.records import Attestation, Head, Proposal, Update
from p2ptrain.core.tensors import encode_state_dict
from p2ptrain.errors import LocalError
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.trainer import TrainerMachine
from p2ptrain.sim.attacks import AttackContext, attack_named

if TYPE_CHECKING:
    from p2ptrain.sim.outbox import Outbox, Sender
    from p2ptrain.sim.workloads import SimWorkload

__all__ = ["equivocate", "proposal_to_send", "trained_update"]


def trained_update(
    outbox: Outbox,
    sender: Sender,
    machine: TrainerMachine,
    action: act.Train,
    *,
    workload: SimWorkload,
    trainer_index: int,
    encoder: WindowEncoders,
) -> tuple[bytes, float, float] | None:
    """The trainer's window is done: the honest (or Byzantine) blob and losses to hand its
    policy, or None when an adversary sent what its behaviour says instead."""
    base = machine.base
    if base.head_id != action.base_head:
        return None  # the head moved while training: the work is stale
    behaviour = sender.behaviour
    if behaviour == "replayer":
        _replay(outbox, sender, action.window)
    elif behaviour == "forger":
        _forge(outbox, sender, machine, action)
    elif behaviour == "stale":
        _stale(outbox, sender, machine, action)
    if behaviour in ("replayer", "forger", "stale"):
        return None
    scenario = outbox.scenario
    lease = machine.lease(action.window)
    attack = attack_named(scenario.attack) if behaviour == "byzantine" else None
    poison = attack is not None and attack.poisons_data
    delta, before, after = workload.train(
        base.weights, lease, trainer_index, action.window, poison=poison
    )
    if attack is not None and not attack.poisons_data:
        own = flatten(delta)
        generator = torch.Generator().manual_seed(scenario.seed * 7919 + trainer_index)
        context = AttackContext(own, [own], scenario.byzantine, scenario.trainers, generator)
        delta = unflatten(attack.forge(context), delta)
    try:
        blob = encoder.at(action.window).encode(delta)
    except LocalError:  # e.g. NaN: the codec refuses, so send the raw tensors instead
        blob = bytes(encode_state_dict(delta))
    return blob, before, after


def _replay(outbox: Outbox, sender: Sender, window: int) -> None:
    """Re-send up to 20 updates of the previous window (seen on the wire)."""
    old = [
        (update_id, sent)
        for update_id, sent in sorted(outbox.published.items())
        if outbox.observer.window_of(update_id) == window - 1
    ][:20]
    for update_id, (envelope, blob) in old:
        outbox.observer.replayed.add(update_id)
        outbox.send_update(sender, envelope, blob)


def _forged_update(machine: TrainerMachine, action: act.Train, shards: tuple[str, ...]) -> Update:
    blob = b"\x00" * 64
    return Update(
        experiment_id=machine.experiment_id,
        window=action.window,
        base_head=action.base_head,
        trainer=machine.key,
        lease_shards=shards,
        lease_samples=machine.manifest.lease_size,
        delta_blob=sha256_hex(blob),
        delta_bytes=len(blob),
        codec=machine.manifest.codec.name,
        loss_before=1.0,
        loss_after=0.5,
    )


def _forge(outbox: Outbox, sender: Sender, machine: TrainerMachine, action: act.Train) -> None:
    """A bad signature (caught when the envelope is opened), and a correctly signed update
    with a cherry-picked lease (rejected by every reducer; strikes lead to quarantine)."""
    all_shards = tuple(sorted(s.name for s in machine.manifest.dataset.shards))
    picked = all_shards[:1]
    forged = seal(machine.identity, _forged_update(machine, action, picked))
    broken = bytearray(forged.envelope.signature)
    broken[0] ^= 0xFF
    bad = Envelope(kind=forged.envelope.kind, payload=forged.envelope.payload,
                   signer=forged.envelope.signer, signature=bytes(broken))  # fmt: skip
    outbox.observer.forged.add(forged.record_id)
    outbox.send_update(sender, bad.encode(), b"\x00" * 64)
    if machine.lease(action.window).shards != picked:
        cherry = seal(machine.identity, _forged_update(machine, action, picked))
        outbox.observer.saw_update(cherry, "forger")
        envelope = bytes(cherry.envelope.encode())
        outbox.send_update(sender, envelope, b"\x00" * 64, cherry.record_id)


def _stale(outbox: Outbox, sender: Sender, machine: TrainerMachine, action: act.Train) -> None:
    """An update built on the genesis head whatever the canonical head is."""
    genesis = machine.chain.at(0)
    assert genesis is not None
    if genesis.head_id == action.base_head:
        return
    update = _forged_update(machine, act.Train(action.window, genesis.head_id), tuple(
        machine.lease(action.window).shards))  # fmt: skip
    signed = seal(machine.identity, update)
    outbox.observer.stale.add(signed.record_id)
    outbox.send_update(sender, bytes(signed.envelope.encode()), b"\x00" * 64)


def proposal_to_send(
    outbox: Outbox, sender: Sender, signed: Signed[Proposal]
) -> Signed[Proposal] | None:
    if sender.behaviour == "silent_reducer":
        return None
    if sender.behaviour != "lying_reducer":
        return signed
    honest = signed.record
    lie = msgspec.structs.replace(
        honest.head, weights_blob=sha256_hex(b"lie" + honest.head.weights_blob.encode())
    )
    fields: dict[str, Any] = {f: getattr(honest, f) for f in honest.__struct_fields__}
    fields["head"] = lie
    forged = seal(sender.identity, Proposal(**fields))
    outbox.observer.lies.add(lie.id)
    return forged


def equivocate(
    outbox: Outbox, sender: Sender, honest: Signed[Attestation]
) -> list[Signed[Attestation]]:
    """An equivocating validator also votes for a forged head at the same height, round and
    stage, and sends a certificate for it when its own commit is a quorum (a minority-quorum
    manifest)."""
    if sender.behaviour != "equivocating_validator":
        return []
    record = honest.record
    forged = Head(
        experiment_id=record.experiment_id,
        height=record.height,
        parent=sender.machine.base.head_id,
        weights_blob=sha256_hex(f"forged/{record.height}".encode()),
        optimizer_blob=None,
        aggregate_blob=sha256_hex(f"forged aggregate/{record.height}".encode()),
    )
    second = seal(sender.identity, Attestation(experiment_id=record.experiment_id,
                  height=record.height, head_id=forged.id, validator=record.validator,
                  round=record.round, stage=record.stage))  # fmt: skip
    outbox.observer.lies.add(forged.id)
    if record.stage == "commit":
        certificate = QuorumCertificate.assemble([second])
        if certificate.verify(outbox.manifest):
            outbox.send_certificate(sender, forged, certificate)
    return [second]
