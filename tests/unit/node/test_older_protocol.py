"""A data directory (or a peer) of an older protocol version is refused, naming both
versions, what changed and what to do: its chain cannot be read by this release."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from p2ptrain.core.encoding import encode, sha256_hex
from p2ptrain.core.envelope import Envelope, open_envelope, seal, signing_message
from p2ptrain.core.manifests import PROTOCOL_VERSION, NetworkManifest
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.setup import _restored
from p2ptrain.store.datadir import DataDir
from tests.support.builders import experiment, identity

AUTHORITY = identity(1000)
OLD = 4


def _old_network() -> bytes:
    """A network manifest that says protocol 4, signed by its authority (what a data
    directory of the last release holds)."""
    network = NetworkManifest(name="old-net", authority=AUTHORITY.public_key)
    fields = msgspec.to_builtins(network, builtin_types=(bytes,))
    fields["protocol_version"] = OLD
    payload = encode(fields)
    signature = AUTHORITY.sign(signing_message("network", payload))
    envelope = Envelope(
        kind="network", payload=payload, signer=AUTHORITY.public_key, signature=signature
    )
    return encode(envelope)


def test_a_peers_older_manifest_is_refused_with_both_versions() -> None:
    with pytest.raises(ProtocolViolation) as info:
        open_envelope(_old_network(), NetworkManifest)
    message = str(info.value)
    assert f"is {OLD}" in message and f"protocol {PROTOCOL_VERSION} only" in message
    assert "is stored sparse" in message and f"release of protocol {OLD}" in message


def test_a_data_directory_of_protocol_4_is_refused_with_what_to_do(tmp_path: Path) -> None:
    raw = _old_network()
    manifest = msgspec.structs.replace(
        experiment([identity(i) for i in range(3)], quorum=2, authority=AUTHORITY),
        network_id=sha256_hex(msgspec.msgpack.decode(raw)["payload"]),
    )
    signed = seal(AUTHORITY, manifest)
    with DataDir(tmp_path) as datadir:
        store = NodeStore(datadir)
        store.state.put_record(
            signed.record_id, "experiment", bytes(signed.envelope.encode()),
            experiment_id=signed.record_id, signer=signed.signer_id,
        )  # fmt: skip
        store.state.put_record(manifest.network_id, "network", raw, signer=signed.signer_id)
        with pytest.raises(LocalError) as info:
            _restored(identity(5), store, signed.record_id)
    message = str(info.value)
    print(message)
    assert str(tmp_path) in message
    assert f"is {OLD}; this p2ptrain speaks protocol {PROTOCOL_VERSION}" in message
    assert "new --dir" in message
