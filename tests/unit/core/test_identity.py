"""Identities, peer ids and the key file in a data directory."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from p2ptrain.core.identity import Identity, peer_id_of, verify_signature
from p2ptrain.errors import LocalError
from p2ptrain.store.keyfile import create_identity, identity_path, load_identity


def test_peer_id_is_sha256_of_the_public_key() -> None:
    me = Identity.from_seed(bytes(range(32)))
    assert me.peer_id == hashlib.sha256(me.public_key).hexdigest() == peer_id_of(me.public_key)
    # RFC 8032 test vector 1: the public key of the all-zero-prefixed seed
    rfc = Identity.from_seed(
        bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
    )
    assert rfc.public_key.hex() == (
        "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
    )
    assert rfc.sign(b"").hex().startswith("e5564300c360ac729086e2cc806e828a")


def test_signatures_verify_only_for_the_right_key_and_message() -> None:
    alice, bob = Identity.generate(), Identity.generate()
    sig = alice.sign(b"hello")
    assert verify_signature(alice.public_key, b"hello", sig)
    assert not verify_signature(bob.public_key, b"hello", sig)
    assert not verify_signature(alice.public_key, b"hellO", sig)
    assert not verify_signature(alice.public_key, b"hello", sig[:-1])
    assert not verify_signature(b"\x00" * 31, b"hello", sig)
    assert not verify_signature(b"\xff" * 32, b"hello", sig)  # not a curve point


def test_pem_round_trip() -> None:
    me = Identity.generate()
    assert Identity.from_pem(me.to_pem()).public_key == me.public_key
    with pytest.raises(LocalError, match="not a valid PEM"):
        Identity.from_pem(b"garbage")
    with pytest.raises(LocalError, match="32 bytes"):
        Identity.from_seed(b"short")


def test_create_writes_a_private_key_file_and_refuses_to_overwrite(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    created = create_identity(data_dir)
    path = identity_path(data_dir)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_identity(data_dir).peer_id == created.peer_id
    before = path.read_bytes()
    with pytest.raises(LocalError, match="never overwrites"):
        create_identity(data_dir)
    assert path.read_bytes() == before


def test_load_refuses_a_key_others_can_read(tmp_path: Path) -> None:
    create_identity(tmp_path)
    os.chmod(identity_path(tmp_path), 0o644)
    with pytest.raises(LocalError, match="chmod 600"):
        load_identity(tmp_path)


def test_load_explains_a_missing_identity(tmp_path: Path) -> None:
    with pytest.raises(LocalError, match="p2ptrain init --dir"):
        load_identity(tmp_path / "nowhere")
