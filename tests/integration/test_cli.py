"""The p2ptrain command, run as a real process."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from p2ptrain import __version__
from p2ptrain.core.envelope import open_envelope
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.store.state import StateStore

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "experiment.toml"


def p2ptrain(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    executable = shutil.which("p2ptrain", path=str(Path(sys.executable).parent))
    command = [executable] if executable else [sys.executable, "-m", "p2ptrain.cli.main"]
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={k: v for k, v in os.environ.items() if k != "P2PTRAIN_DIR"},
        check=False,
    )


def test_version_and_help() -> None:
    result = p2ptrain("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"p2ptrain {__version__}"
    result = p2ptrain("--help")
    assert result.returncode == 0
    for command in ("init", "experiment", "bench"):
        assert command in result.stdout


def test_init_prints_the_peer_id_and_refuses_to_overwrite(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    result = p2ptrain("init", "--dir", str(data_dir), "--json")
    assert result.returncode == 0, result.stderr
    created = json.loads(result.stdout)
    assert len(created["peer_id"]) == 64
    key = data_dir / "identity.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert (data_dir / "node.db").exists()
    before = key.read_bytes()
    again = p2ptrain("init", "--dir", str(data_dir))
    assert again.returncode == 2
    assert "never overwrites" in again.stderr
    assert key.read_bytes() == before
    shown = p2ptrain("identity", "--dir", str(data_dir), "--json")
    assert json.loads(shown.stdout)["peer_id"] == created["peer_id"]


def test_experiment_create_signs_stores_and_prints_the_id(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    assert p2ptrain("init", "--dir", str(data_dir)).returncode == 0
    out = tmp_path / "exp.experiment"
    result = p2ptrain(
        "experiment", "create", str(EXAMPLE), "--dir", str(data_dir), "--out", str(out)
    )
    assert result.returncode == 0, result.stderr
    experiment_id = result.stdout.strip()
    signed = open_envelope(out.read_bytes(), ExperimentManifest)
    assert signed.record_id == experiment_id == signed.record.id
    with StateStore(data_dir / "node.db") as state:
        assert state.get_record(experiment_id) == out.read_bytes()
    shown = json.loads(p2ptrain("experiment", "show", str(out)).stdout)
    assert shown["experiment_id"] == experiment_id
    assert shown["manifest"]["quorum"] == 2


def test_a_bad_experiment_file_gets_a_message_naming_the_field(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    assert p2ptrain("init", "--dir", str(data_dir)).returncode == 0
    bad = tmp_path / "bad.toml"
    bad.write_text(EXAMPLE.read_text().replace("min_updates = 2", "min_updates = 0"))
    result = p2ptrain("experiment", "create", str(bad), "--dir", str(data_dir))
    assert result.returncode == 2
    assert "window.min_updates: must be between 1" in result.stderr
    assert "Traceback" not in result.stderr
    minority = tmp_path / "minority.toml"
    minority.write_text(EXAMPLE.read_text().replace("quorum = 2", "quorum = 1"))
    result = p2ptrain("experiment", "create", str(minority), "--dir", str(data_dir))
    assert result.returncode == 2
    assert "not a majority" in result.stderr
    allowed = p2ptrain(
        "experiment", "create", str(minority), "--dir", str(data_dir), "--allow-minority-quorum"
    )
    assert allowed.returncode == 0, allowed.stderr


def test_a_seed_refuses_a_minority_quorum_and_names_the_opt_in(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    assert "quorum = 2" in text and text.count('",\n]') == 1  # 3 validators: 2 is a majority
    minority = tmp_path / "minority.toml"
    minority.write_text(text.replace('",\n]', f'",\n    "{1:064x}",\n]'))
    result = p2ptrain("seed", "--experiment-toml", str(minority), "--dir", str(tmp_path / "s"))
    assert result.returncode == 2, result.stderr
    assert "quorum 2 of 4 validators is not a majority" in result.stderr
    assert "--allow-minority-quorum" in result.stderr and "Traceback" not in result.stderr


def test_experiment_show_rejects_a_tampered_file(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    assert p2ptrain("init", "--dir", str(data_dir)).returncode == 0
    out = tmp_path / "exp.experiment"
    assert (
        p2ptrain(
            "experiment", "create", str(EXAMPLE), "--dir", str(data_dir), "--out", str(out)
        ).returncode
        == 0
    )
    data = bytearray(out.read_bytes())
    data[len(data) // 2] ^= 0x01
    out.write_bytes(bytes(data))
    result = p2ptrain("experiment", "show", str(out))
    assert result.returncode == 2
    assert "is not a valid signed experiment" in result.stderr


def test_commands_without_a_data_directory_say_what_to_do(tmp_path: Path) -> None:
    result = p2ptrain("experiment", "create", str(EXAMPLE), "--dir", str(tmp_path / "none"))
    assert result.returncode == 2
    assert "p2ptrain init --dir" in result.stderr
