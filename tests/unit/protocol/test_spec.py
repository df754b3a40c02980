"""The tables of docs/protocol.md that the code defines are the code's: regenerate them
with ``python -m p2ptrain.protocol.spec docs/protocol.md`` after changing one."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2ptrain.core.manifests import PROTOCOL_VERSION
from p2ptrain.core.reasons import Code
from p2ptrain.protocol.spec import tables, update_doc

DOC = Path(__file__).parents[3] / "docs" / "protocol.md"


def test_the_protocol_doc_holds_the_tables_the_code_generates() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert update_doc(text) == text, "run: python -m p2ptrain.protocol.spec docs/protocol.md"


def test_the_tables_say_the_version_and_every_code() -> None:
    generated = tables()
    assert (
        f"| {PROTOCOL_VERSION} | a rounded (int8, int4, int2) aggregate is stored sparse"
        in generated["versions"]
    )
    for code in Code:
        assert f"| {code.value} | `{code.name}` |" in generated["reasons"]


def test_a_doc_without_a_table_block_is_refused() -> None:
    with pytest.raises(ValueError, match="generated: versions"):
        update_doc("no blocks here")
