"""Property tests of signed envelopes: flipping any byte of one fails its verification,
and a valid envelope with bytes inserted, deleted or truncated raises only
ProtocolViolation. Each runs at least 1000 examples (the records themselves:
``test_record_properties.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.core.envelope import KINDS, open_envelope, seal
from p2ptrain.errors import ProtocolViolation
from tests.support import strategies as s

EXAMPLES = settings(max_examples=1000)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_flipping_any_byte_of_a_signed_envelope_fails_verification(kind: str) -> None:
    record_type = KINDS[kind].type
    strategy = s.AUTHORED[kind]

    @EXAMPLES
    @given(s.identities, st.data())
    def check(identity: Any, data: st.DataObject) -> None:
        record = data.draw(strategy(identity.public_key))
        wire = seal(identity, record).envelope.encode()
        assert open_envelope(wire, record_type).record == record
        index = data.draw(st.integers(0, len(wire) - 1), label="index")
        mask = data.draw(st.integers(1, 255), label="xor mask")
        tampered = bytearray(wire)
        tampered[index] ^= mask
        with pytest.raises(ProtocolViolation):
            open_envelope(bytes(tampered), record_type)

    check()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_mutated_envelopes_raise_only_protocol_violation(kind: str) -> None:
    """Structure-aware fuzzing: valid envelopes with bytes inserted, deleted or truncated."""
    record_type = KINDS[kind].type
    strategy = s.AUTHORED[kind]

    @EXAMPLES
    @given(s.identities, st.data())
    def check(identity: Any, data: st.DataObject) -> None:
        wire = seal(identity, data.draw(strategy(identity.public_key))).envelope.encode()
        start = data.draw(st.integers(0, len(wire)))
        end = data.draw(st.integers(start, min(len(wire), start + 8)))
        filler = data.draw(st.binary(max_size=8))
        mutated = wire[:start] + filler + wire[end:]
        if mutated == wire:
            return
        with pytest.raises(ProtocolViolation):
            open_envelope(mutated, record_type)

    check()
