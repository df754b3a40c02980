"""Rejection reasons as codes: validated on decode, said in words from the code alone, and
the table in docs/protocol.md is the code's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from p2ptrain.core.encoding import decode, encode
from p2ptrain.core.reasons import ARITY, TEXTS, Code, Reason, describe
from p2ptrain.errors import InvalidRecord, ProtocolViolation

DOC = Path(__file__).parents[3] / "docs" / "protocol.md"


def test_every_code_has_a_text_and_reads_with_its_arguments() -> None:
    assert set(TEXTS) == set(Code)
    assert describe(Reason(Code.NORM_ABOVE, (1007.604, 3.0))) == (
        "norm 1007.60x the cohort median exceeds 3.0x"
    )
    assert str(Reason(Code.QUARANTINED, (8,))) == "trainer is quarantined until window 8"
    assert describe(Reason(Code.WRONG_CODEC, ("fp16", "fp32"))) == (
        "codec 'fp16', the experiment uses 'fp32'"
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


def test_the_protocol_doc_lists_every_code_with_its_arity() -> None:
    rows = re.findall(r"^\| (\d+) \| `([A-Z_0-9]+)` \| ([^|]+) \|", DOC.read_text(), re.M)
    documented = {int(number): (name, args.strip()) for number, name, args in rows}
    assert {n: name for n, (name, _) in documented.items()} == {c.value: c.name for c in Code}
    for code in Code:
        _, args = documented[code.value]
        count = 0 if args == "\u2013" else len(args.split(","))  # an en dash: none
        assert count == ARITY[code], code.name
