"""A trainer's error-feedback residual survives a restart: what a window saves with the inner
optimizer state gives a new encoder the residual the old one had, so the next update is the
very one the trainer would have sent without the restart; an update the chain did not accept
goes back into the residual."""

from __future__ import annotations

import torch

from p2ptrain.aggregate.codecs import decode_update, make_encoder
from p2ptrain.bench.chaos_network import TINY_WORKLOAD
from p2ptrain.core.manifests import CodecSpec
from p2ptrain.core.tensors import schema_of
from p2ptrain.node.trainer_window import split_saved_state, train_update
from p2ptrain.torch.char_gpt import char_gpt_workload

CODEC = CodecSpec(name="sparseloco", config={"fraction": 0.02, "bits": 2})


def test_a_restarted_trainer_sends_what_it_would_have_sent() -> None:
    workload = char_gpt_workload(TINY_WORKLOAD)
    base = workload.initial_weights()
    schema = schema_of(base)
    encoder = make_encoder(CODEC, schema)
    saved: dict[str, torch.Tensor] = {}
    first = train_update(workload, encoder, base, list(range(64)), steps=2, seed=1,
                         save_state=saved.update)  # fmt: skip
    optimizer, residuals = split_saved_state(saved)
    assert set(residuals) == {spec.name for spec in schema}
    assert set(optimizer) == set(workload.optimizer_state())
    assert any(bool(r.abs().sum() > 0) for r in residuals.values())  # top-2% left most behind

    delta = {name: torch.full_like(t, 1e-3) for name, t in base.items()}
    restarted = make_encoder(CODEC, schema)
    restarted.load_residuals(residuals)
    assert restarted.encode(delta) == encoder.encode(delta)  # bit for bit, as if never stopped

    # the chain did not accept the first update: what it carried is sent again later
    requeued = make_encoder(CODEC, schema)
    requeued.load_residuals(residuals)
    requeued.requeue_unaccepted(first.blob)
    sent = decode_update(first.blob, CODEC, schema, max_bytes=1 << 24)
    for name, residual in requeued.residuals().items():
        assert torch.equal(residual, residuals[name] + sent[name])
