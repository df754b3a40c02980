"""Rejection reasons as codes: validated on decode, said in words from the code alone."""

from __future__ import annotations

import pytest

from p2ptrain.core.encoding import decode, encode
from p2ptrain.core.reasons import ARGS, ARITY, TEXTS, Code, Reason, describe
from p2ptrain.errors import InvalidRecord, ProtocolViolation


def test_every_code_has_a_text_and_reads_with_its_arguments() -> None:
    assert set(TEXTS) == set(ARGS) == set(Code)
    for code in Code:  # as many places in the text as the code has arguments
        assert TEXTS[code].count("{") == ARITY[code], code.name
    assert describe(Reason(Code.NORM_ABOVE, (1007.604, 3.0))) == (
        "norm 1007.60x the cohort median exceeds 3.0x"
    )
    assert str(Reason(Code.QUARANTINED, (8,))) == "trainer is quarantined until window 8"
    assert describe(Reason(Code.WRONG_CODEC, ("fp16", "fp32"))) == (
        "codec 'fp16', the experiment uses 'fp32' in this window"
    )


@pytest.mark.parametrize(
    ("code", "args", "field"),
    [
        (99, (), "reason.code"),
        (Code.REPEATED, (1,), "reason.args"),
        (Code.NORM_ABOVE, (1.0,), "reason.args"),
        (Code.NORM_ABOVE, (float("nan"), 3.0), "reason.args"),
        (Code.NOT_FINITE, ("x" * 65,), "reason.args"),
    ],
)
def test_a_malformed_reason_is_refused(code: int, args: tuple[object, ...], field: str) -> None:
    with pytest.raises(InvalidRecord) as info:
        Reason(code, args)  # type: ignore[arg-type]
    assert info.value.field == field


def test_a_reason_round_trips_and_bad_bytes_raise_protocol_violation() -> None:
    reason = Reason(Code.LEASE_SAMPLES, (24, 25))
    data = encode(reason)
    assert decode(Reason, data, max_bytes=len(data)) == reason
    assert encode(decode(Reason, data, max_bytes=len(data))) == data
    with pytest.raises(ProtocolViolation):
        decode(Reason, encode([77, []]), max_bytes=64)
