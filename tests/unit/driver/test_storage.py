"""Storage faults: recognised from what the disk says, reported once, cleared by a write."""

from __future__ import annotations

import errno
import logging
import sqlite3
from pathlib import Path

import pytest

from p2ptrain.driver.storage import StorageHealth, as_storage_fault
from p2ptrain.errors import StorageFault, TransportError
from p2ptrain.store.atomic import overwrite_in_place


def test_disk_errors_are_storage_faults_and_others_are_not() -> None:
    full = OSError(errno.ENOSPC, "No space left on device", "/data/blobs/x")
    fault = as_storage_fault(full)
    assert fault is not None and fault.path == "/data/blobs/x"
    assert "free disk space" in str(fault)
    read_only = as_storage_fault(OSError(errno.EROFS, "Read-only file system", "/data"))
    assert read_only is not None
    assert as_storage_fault(sqlite3.OperationalError("database or disk is full")) is not None
    assert as_storage_fault(OSError(errno.ECONNRESET, "reset")) is None
    assert as_storage_fault(TransportError("peer hung up")) is None
    assert as_storage_fault(ValueError("a bug")) is None
    try:
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("while storing a head") from exc
    except RuntimeError as wrapped:
        assert as_storage_fault(wrapped) is not None  # found through the cause


def test_a_storage_fault_is_logged_once_and_cleared_by_a_write(
    caplog: pytest.LogCaptureFixture,
) -> None:
    health = StorageHealth()
    with caplog.at_level(logging.DEBUG, logger="p2ptrain.driver.storage"):
        for _ in range(50):
            assert health.check("fetching", StorageFault("/d/blobs", "No space left on device"))
        assert not health.check("fetching", TransportError("not a disk problem"))
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "/d/blobs" in warnings[0].getMessage()
    assert not any(r.exc_info for r in caplog.records)  # no tracebacks
    assert health.problem is not None and health.problem.failures == 50
    assert health.problem.path == "/d/blobs"
    health.succeeded()
    assert health.problem is None


def test_a_status_rewritten_in_place_fits_the_blocks_it_holds(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    path.write_bytes(b"x" * 100)
    overwrite_in_place(path, b'{"ok": true}')
    assert path.read_bytes() == b'{"ok": true}' + b" " * 88
    with pytest.raises(OSError, match="do not fit"):
        overwrite_in_place(path, b"y" * 101)
