"""Whole-file replacement: durable files are fsynced before the rename, reports are not, and
both are replaced whole."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from p2ptrain.errors import LocalError
from p2ptrain.store.atomic import write_atomically


def test_reports_skip_the_fsync_that_durable_files_wait_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    path = tmp_path / "status.json"
    write_atomically(path, b"old")
    assert len(synced) == 1
    write_atomically(path, b"new report", durable=False)
    assert len(synced) == 1 and path.read_bytes() == b"new report"
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temporary left


def test_a_write_that_cannot_happen_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(LocalError, match=r"cannot write .*missing/status.json"):
        write_atomically(tmp_path / "missing" / "status.json", b"x", durable=False)
