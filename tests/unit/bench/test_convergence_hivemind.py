"""How the convergence bench finds the interpreter for its hivemind peers and tells whether
it can run one (stand-in interpreters: no hivemind needed), and how it decides from the
peers' weight probes that an epoch was averaged."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from p2ptrain.bench.convergence_hivemind import (
    ANCHORS_VENV,
    HIVEMIND_VERSION,
    PYTHON_ENV,
    averaged_epochs,
    hivemind_python,
    hivemind_python_candidate,
    hivemind_unavailable,
)
from p2ptrain.bench.hivemind_peer import PROBE_TOLERANCE, weights_probe


def _fake_python(path: Path, body: str) -> str:
    """An executable that stands in for an interpreter: a shell script running ``body``."""
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def _reporting(path: Path, errors: dict[str, str], version: str | None) -> str:
    report = json.dumps({"errors": errors, "version": version})
    return _fake_python(path, f"echo '{report}'")


def test_the_candidate_is_the_explicit_path_then_the_environment_then_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    default = str(tmp_path / ANCHORS_VENV / "bin" / "python")
    assert hivemind_python_candidate(None) == default
    monkeypatch.setenv(PYTHON_ENV, "/opt/anchors/bin/python")
    assert hivemind_python_candidate(None) == "/opt/anchors/bin/python"
    assert hivemind_python_candidate("/elsewhere/python") == "/elsewhere/python"
    # Relative paths are made absolute, links are not followed (that would leave the venv).
    assert hivemind_python_candidate("venv/bin/python") == str(tmp_path / "venv/bin/python")


def test_a_missing_interpreter_is_unavailable_with_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    reason = hivemind_unavailable(hivemind_python_candidate(None))
    assert reason is not None
    assert ANCHORS_VENV in reason and "does not exist" in reason
    assert "make bench-anchors" in reason
    assert hivemind_python(None) is None


def test_an_interpreter_without_hivemind_is_unavailable() -> None:
    # The interpreter running the tests: it has p2ptrain, not hivemind.
    reason = hivemind_unavailable(sys.executable)
    assert reason is not None
    assert "hivemind is not installed" in reason and "make bench-anchors" in reason


def test_an_interpreter_with_hivemind_and_p2ptrain_is_available(tmp_path: Path) -> None:
    python = _reporting(tmp_path / "python", {}, HIVEMIND_VERSION)
    assert hivemind_unavailable(python) is None
    assert hivemind_python(python) == python


def test_what_the_interpreter_lacks_is_named(tmp_path: Path) -> None:
    no_project = _reporting(
        tmp_path / "a", {"p2ptrain.bench.hivemind_peer": "ModuleNotFoundError: p2ptrain"}, "1"
    )
    reason = hivemind_unavailable(no_project)
    assert reason is not None and reason.startswith("p2ptrain is not installed")
    other = _reporting(tmp_path / "b", {}, "1.0.0")
    reason = hivemind_unavailable(other)
    assert reason is not None and "hivemind 1.0.0" in reason and HIVEMIND_VERSION in reason
    broken = _fake_python(tmp_path / "c", "echo 'Segmentation fault' >&2; exit 139")
    reason = hivemind_unavailable(broken)
    assert reason is not None and "exit 139" in reason and "Segmentation fault" in reason
    not_executable = tmp_path / "d"
    not_executable.write_text("")
    assert "does not exist" in (hivemind_unavailable(str(not_executable)) or "")
    assert hivemind_python(str(not_executable)) is None
    assert os.path.isfile(not_executable)


def test_an_epoch_counts_as_averaged_when_every_peer_held_the_same_weights() -> None:
    base = [0.5, -0.25, 1.0]
    rounding = [value + PROBE_TOLERANCE / 10 for value in base]
    apart = [value + 0.01 for value in base]
    rank0 = [{"epoch": 1, "probe": base}, {"epoch": 2, "probe": base}, {"epoch": 3, "probe": base}]
    rank1 = [{"epoch": 1, "probe": rounding}, {"epoch": 2, "probe": apart}]
    rank2 = [{"epoch": 1, "probe": base}, {"epoch": 2, "probe": base}, {"epoch": 3, "probe": base}]
    # Epoch 1: all agree; epoch 2: rank 1 did not average; epoch 3: rank 1 never got there.
    assert averaged_epochs([rank0, rank1, rank2]) == 1
    assert averaged_epochs([rank0, rank2]) == 3
    assert averaged_epochs([]) == 0


def test_the_probe_reads_fixed_positions_of_all_weights() -> None:
    import torch

    weights = {"b": torch.arange(10.0), "a": torch.arange(100.0, 106.0).reshape(2, 3)}
    probe = weights_probe(weights, count=4)
    # Names in sorted order: a's six values, then b's ten; positions 0, 5, 10, 15.
    assert probe == [100.0, 105.0, 4.0, 9.0]
    assert weights_probe(weights) == [float(v) for v in [*range(100, 106), *range(10)]]
