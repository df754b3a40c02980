"""Test vectors for reducing a window, generated from the protocol package.

Each vector is one window: the experiment manifest and the base head (canonical msgpack,
hex), the base weights (safetensors, hex), the signed updates and their blobs (hex), and
what every reducer and validator must compute from them: the accepted update ids, each
rejection's code and arguments, the next quarantine book, the aggregate's hash and the head
id. Another implementation of the protocol can run them (``reduction_vectors.json``);
``tests/unit/protocol/test_vectors.py`` checks that this one still does.

    python -m tests.golden.make_vectors            # rewrite tests/golden/reduction_vectors.json
    python -m tests.golden.make_vectors --out DIR  # write DIR/reduction_vectors.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import torch

from p2ptrain.aggregate.codecs import make_encoder
from p2ptrain.core.encoding import encode, sha256_hex
from p2ptrain.core.envelope import seal
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import (
    PROTOCOL_VERSION,
    AggregationSpec,
    CodecSpec,
    DatasetManifest,
    OuterOptimizerSpec,
    ScreeningSpec,
    ShardInfo,
    WindowSpec,
)
from p2ptrain.core.reasons import Code, Reason
from p2ptrain.core.records import Head, QuarantineEntry, Update
from p2ptrain.core.tensors import encode_state_dict, schema_of
from p2ptrain.protocol.chain import genesis_head
from p2ptrain.protocol.leases import LeaseBook, lease_for
from p2ptrain.protocol.reduction import BaseState, Reduction, Submission, reduce_window
from tests.support.builders import experiment, h, identity

__all__ = ["FILE", "vectors"]

FILE = Path(__file__).with_name("reduction_vectors.json")

Tensors = dict[str, torch.Tensor]
TRAINERS = [identity(300 + i) for i in range(6)]

MANIFEST = msgspec.structs.replace(
    experiment([identity(i) for i in range(3)], quorum=2),
    dataset=DatasetManifest(
        name="vectors",
        shards=tuple(
            ShardInfo(name=f"shard-{i}", blob_id=h(f"shard-{i}"), samples=10) for i in range(8)
        ),
    ),
    lease_size=25,
    protocol="fedavg",
    outer_optimizer=OuterOptimizerSpec(name="sgd", lr=1.0, momentum=0.0),
    codec=CodecSpec(name="fp32"),
    aggregation=AggregationSpec(rule="trimmed_mean"),
    screening=ScreeningSpec(quarantine_after=2, quarantine_windows=3),
    window=WindowSpec(min_updates=1, max_updates=20),
)


def _weights() -> Tensors:
    return {
        "w": (torch.arange(12, dtype=torch.float32).reshape(4, 3) - 6.0) * 0.5,
        "b": torch.tensor([1.0, -1.0, 0.25], dtype=torch.float32),
    }


def _delta(i: int, scale: float = 1.0) -> Tensors:
    w = torch.full((4, 3), 0.5, dtype=torch.float32)
    w[i % 4, i % 3] += 0.25 * (i + 1)
    b = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float32)
    b[i % 3] -= 0.25
    return {"w": w * scale, "b": b * scale}


def _blob(tensors: Mapping[str, torch.Tensor], codec: str = "fp32") -> bytes:
    return make_encoder(CodecSpec(name=codec), schema_of(_weights())).encode(tensors)


def _submit(
    trainer: Identity,
    base: BaseState,
    tensors: Tensors,
    *,
    blob: bytes | None = None,
    sent: bytes | None = None,
    **changes: object,
) -> Submission:
    lease = lease_for(MANIFEST, base.window, trainer.peer_id)
    named = _blob(tensors) if blob is None else blob
    fields: dict[str, object] = {
        "experiment_id": MANIFEST.id,
        "window": base.window,
        "base_head": base.head_id,
        "trainer": trainer.public_key,
        "lease_shards": lease.shards,
        "lease_samples": lease.samples,
        "delta_blob": sha256_hex(named),
        "delta_bytes": len(named),
        "codec": MANIFEST.codec.name,
        "loss_before": 2.0,
        "loss_after": 1.5,
    }
    fields.update(changes)
    signed = seal(trainer, Update(**fields))  # type: ignore[arg-type]
    return Submission(signed.record, signed.record_id, named if sent is None else sent)


def _genesis() -> BaseState:
    head = genesis_head(MANIFEST)
    return BaseState(head, head.id, _weights())


def _quarantined_base() -> BaseState:
    """A head at height 2 that excludes trainer 5 through window 4 and holds a strike of
    trainer 0 (its next accepted update clears it)."""
    book = [
        QuarantineEntry(
            peer_id=TRAINERS[5].peer_id, until_window=4, reason=Reason(Code.UNDECODABLE), offences=1
        ),
        QuarantineEntry(
            peer_id=TRAINERS[0].peer_id,
            until_window=0,
            reason=Reason(Code.BLOB_MISMATCH),
            strikes=1,
        ),
    ]
    head = Head(
        experiment_id=MANIFEST.id,
        height=2,
        parent=h("vectors-height-1"),
        weights_blob=sha256_hex(bytes(encode_state_dict(_weights()))),
        optimizer_blob=None,
        accepted=(h("vectors-update"),),
        quarantine=tuple(sorted(book, key=lambda e: e.peer_id)),
        aggregate_blob=h("vectors-aggregate-2"),
    )
    return BaseState(head, head.id, _weights())


def _honest(base: BaseState, count: int = 4) -> list[Submission]:
    return [_submit(TRAINERS[i], base, _delta(i)) for i in range(count)]


def _cases() -> dict[str, tuple[BaseState, list[Submission]]]:
    g = _genesis()
    q = _quarantined_base()
    bad = TRAINERS[4]
    lease = lease_for(MANIFEST, g.window, bad.peer_id)
    return {
        "honest": (g, _honest(g)),
        "norm-outlier": (g, [*_honest(g), _submit(bad, g, _delta(4, scale=100.0))]),
        "opposite-direction": (g, [*_honest(g), _submit(bad, g, _delta(4, scale=-1.0))]),
        "sent-twice": (g, [*_honest(g), _submit(bad, g, _delta(4)), _submit(bad, g, _delta(5))]),
        "wrong-lease-samples": (
            g,
            [*_honest(g), _submit(bad, g, _delta(4), lease_samples=lease.samples - 1)],
        ),
        "blob-mismatch": (
            g,
            [*_honest(g), _submit(bad, g, _delta(4), sent=_blob(_delta(5)))],
        ),
        "undecodable": (g, [*_honest(g), _submit(bad, g, _delta(4), blob=b"\x00" * 64)]),
        "another-codec": (
            g,
            [*_honest(g), _submit(bad, g, _delta(4), blob=_blob(_delta(4), "fp16"), codec="fp16")],
        ),
        "quarantined": (q, [*_honest(q), _submit(TRAINERS[5], q, _delta(5))]),
    }


def _reason(reason: Reason) -> list[Any]:
    return [Code(reason.code).name, *reason.args]


def _expect(reduction: Reduction) -> dict[str, Any]:
    head = reduction.head
    return {
        "accepted": list(reduction.accepted),
        "rejected": [[r.update_id, *_reason(r.reason)] for r in reduction.rejected],
        "quarantine": []
        if head is None
        else [
            [e.peer_id, e.until_window, e.strikes, e.offences, *_reason(e.reason)]
            for e in head.quarantine
        ],
        "aggregate": None
        if reduction.aggregate_blob is None
        else sha256_hex(reduction.aggregate_blob),
        "weights": None if reduction.weights_blob is None else sha256_hex(reduction.weights_blob),
        "head_id": reduction.head_id,
    }


def vectors(reduce: Callable[..., Reduction] = reduce_window) -> dict[str, Any]:
    """Every vector, inputs and expected outputs, as JSON-ready values."""
    out: dict[str, Any] = {
        "protocol": PROTOCOL_VERSION,
        "manifest": encode(MANIFEST).hex(),
        "cases": {},
    }
    for name, (base, cohort) in _cases().items():
        reduction = reduce(MANIFEST, base, cohort, LeaseBook(MANIFEST))
        out["cases"][name] = {
            "base_head": encode(base.head).hex(),
            "base_weights": bytes(encode_state_dict(base.weights)).hex(),
            "updates": [
                {"update": encode(s.update).hex(), "blob": bytes(s.blob).hex()} for s in cohort
            ],
            "expect": _expect(reduction),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=FILE.parent, help="the folder to write to")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / FILE.name
    target.write_text(json.dumps(vectors(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
